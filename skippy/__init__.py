"""The layer-package world: GGUF container I/O, manifests, write/validate/select/verify.

See ../shared/spec/layer-package-repos.md; each module cites the section whose rule it enforces.
"""
