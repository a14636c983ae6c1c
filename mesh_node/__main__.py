"""``python -m mesh_node`` is ``mesh-node`` (tests start real processes this way)."""

from mesh_node.cli import main

raise SystemExit(main())
