"""Consuming packages: hub access, resolution, preflight, verification, materialization."""
