"""What the HTTP surface may show of the status document (pure).

The document (``mesh_node.peers.status_document``) holds no keys, tokens or other nodes'
inventories by construction. One thing in it is local: a topology planned from a package
*directory* names it by absolute path, and error texts may quote paths. The page and
``/api/status`` may be reachable from other machines (``--http-public``), so every absolute
filesystem path in a string becomes ``…/<last component>``; everything else is unchanged (a
document without local paths is served exactly as ``mesh-node status --json`` prints it).
"""

from __future__ import annotations

import re
from typing import Any

# An absolute POSIX path of two or more components, not part of a URL (``ws://h:p``,
# ``hf://ns/repo``: the slash follows ``:`` or ``/``) nor of a relative path (``layers/x``).
_ABS_PATH = re.compile(r"(?<![\w:/.~-])(?:~)?/(?:[^\s/'\"]+/)+([^\s/'\"]*)")
REDACTED_PREFIX = "…/"


def redact_paths(text: str) -> str:
    return _ABS_PATH.sub(lambda m: REDACTED_PREFIX + m.group(1), text)


def public_status(doc: Any) -> Any:
    """The status document with local filesystem paths reduced to their last component."""
    if isinstance(doc, str):
        return redact_paths(doc)
    if isinstance(doc, dict):
        return {k: public_status(v) for k, v in doc.items()}
    if isinstance(doc, list | tuple):
        return [public_status(v) for v in doc]
    return doc
