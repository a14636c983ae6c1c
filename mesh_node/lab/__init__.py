"""``mesh-node lab``: N real nodes on loopback, a local hub, and the transfer report."""
