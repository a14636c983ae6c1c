"""Producing packages: source models, fragment planning and writing, validation, inspection."""
