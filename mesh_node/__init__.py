"""The trio mesh node: links, node state, config and CLI. The only place with sockets and tasks."""
