"""Peer artifact transfer, skippy's side (spec "Peer Cache Transfer").

The spec splits the work: "Mesh owns only the subprotocol open envelope; Skippy owns the
artifact request/response schema, authorization semantics, and byte framing." Everything
here is synchronous and free of sockets, tasks and clocks; ``mesh_node`` opens a
``skippy-stage/2`` stream of kind 0x03 and moves bytes between it and these pieces:

=================  ===========================================================================
``wire``           the request/response schema, length-prefixed msgpack framing, incremental
                   ``RequestReader`` / ``ResponseReader`` (bytes in, values and events out)
``policy``         trust modes: ``would_serve`` (the ``artifact-transfer`` feature bit) and
                   ``peer_refusal`` (pure)
``required``       a stage's servable set, asked of the one selection rule (pure)
``authorize``      ``authorize()``: the decision record for one request (pure)
``fetch_plan``     the worker's plan: manifest first, then its missing parts (pure)
``hubcache``       one pinned package in a hub cache; the held manifest; what is present
``serve``          ``ArtifactServer.serve``: file checks and a bounded body reader
``chunks``         chunk spans, digests and the SHA-256 chain's store; the chunk scheduler
``sources``        the coordinator's signed source list (pure)
``chunk_sink``     ``open_chunk_sink``: the one sink: resumable hidden partial, chunks checked
                   as their bytes arrive, installed atomically into the hub cache layout
=================  ===========================================================================

``docs/architecture.md`` ("Peer artifact transfer") describes the calls the mesh shell makes.
"""
