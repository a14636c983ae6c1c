"""Peer artifact transfer, the mesh's side: the I/O shell around ``skippy.transfer``.

=============  ===============================================================================
``policy``     this node's ``NodePolicy`` and a link's ``PeerFacts`` (the one serving decision)
``records``    transfers in progress and recent, the stage fetch state, counters (status page,
               metrics)
``serve``      the kind 0x03 stream handler: request, ``ArtifactServer.serve``, bounded body
``fetch``      a worker's stage: manifest, plan, peer with resume, hub fallback, ``StageLoad``
``service``    wiring: registers the handler exactly when this node would serve, starts a fetch
               on every new topology where it holds a stage, reports readiness
=============  ===============================================================================
"""
