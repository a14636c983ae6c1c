"""The layer-package format: manifest, references, layer ranges, ownership, selection, planning."""
