"""The layer-package world: GGUF container I/O, manifests, write/validate/select/verify.

The format is summarized in docs/layer-packages.md; each module cites the section whose rule
it enforces by its heading, e.g. spec "Layer Selection" (schema 2's headings start "v2").
"""

__version__ = "0.1.0"  # the one place; pyproject.toml reads it (tool.setuptools.dynamic)
