"""GGUF container I/O: a bounded fast reader and a raw-copy fragment writer."""
