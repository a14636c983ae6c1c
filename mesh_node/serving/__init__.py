"""Split serving: a model as a pipeline of stages on several mesh nodes.

==============  ==============================================================================
``links``       frames over one mesh stream: reader, sender with the in-flight cap, hop figures
``host``        this node's stage (loaded in the stage runtime) and the transport handler
                (kind 0x02): chain sessions, early acks, KV per stage, sampling on the last
``bringup``     the ready hook: load the verified stage, extend the report into the
                admission descriptor (the transfer service fetches and reports)
``pipeline``    the coordinator as the API sees it: admission of requests (queue, 429),
                metrics; joins ``routes`` and ``generator``
``routes``      the route manager: bring-up, restore after a restart, healing, route
                readiness and the 503 reasons
``split``       a split as a value (``SplitSpec``) and the duties one replica is given
``replicas``    R equal splits of one spec, and each request's replica (``Lease``)
``generator``   generation over a route with failover and exact replay; return streams
``state``       the coordinator's persisted run state (``data_dir/serving/split.json``)
``api``         the OpenAI-compatible HTTP routes (starlette, on hypercorn's trio worker)
==============  ==============================================================================

The frames are skippy's (``skippy.stage.stage_frames``, sans-IO); this package moves them.
"""
