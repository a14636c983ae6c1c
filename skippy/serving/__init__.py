"""Serving decisions with no I/O: the OpenAI-compatible request schema, chat templates, and
text streaming (stop strings, incremental UTF-8). ``mesh_node.serving.api`` is the HTTP shell."""
