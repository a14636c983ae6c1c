"""The node's HTTP surface: one starlette app on hypercorn's trio worker, in the node's process.

``app.build_app(node, routes=...)`` makes the app: the read-only operator page (``/``, its
assets under ``/static``), ``/api/status``, ``/api/events`` and ``/metrics``; other components
(the OpenAI API) pass their own routes in. ``server.serve_http(app, bind)`` serves it;
``bind`` decides where it may listen; ``view`` what of the status document it may show.
Nothing is imported here: starlette + hypercorn cost ~0.2 s, paid only by a node that serves.
"""
