"""The layer-package world: GGUF container I/O, manifests, write/validate/select/verify.

See ../shared/spec/layer-package-repos.md; each module cites the section whose rule it enforces.
"""

__version__ = "0.1.0"  # the one place; pyproject.toml reads it (tool.setuptools.dynamic)
