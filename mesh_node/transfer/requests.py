"""A request read off an artifact-family stream (kinds 0x03 artifact, 0x04 source list, 0x05
sibling topology), to the stream's end, before the handler answers.

Every requester sends its request (and, for a source list, its have-report) and then its end
of stream at once. Reading that end before answering is what keeps the answer: a handler that
returns while the requester's end is still on its way closes a stream the peer has not
finished, and ``MeshStream.aclose`` resets such a stream, which drops whatever of the answer
the link had not written yet and clears what the requester had buffered of it. Seen at
bring-up of `mesh-node lab --nodes 7 --replicas 2`: a coordinator's sibling-topology answers
lost as "closed early", after which the holder refused that replica's chunk requests for
``siblings.MISS_TTL_S`` (19 refusals in 1.5 s in one run). Closing such a stream now sends
the answer before the reset (``Multiplexer.finish_then_reset``), but a requester running
older code still drops what it buffered when the reset comes: reading to the end keeps the
answer for both.
"""

from __future__ import annotations

import trio

from mesh_node.link import MeshStream
from skippy.transfer.wire import ArtifactRequest, RequestReader


async def read_request(
    stream: MeshStream, reader: RequestReader, timeout_s: float
) -> ArtifactRequest:
    """The request ``reader`` parses from ``stream``, read through the requester's end of
    stream. Raises ``ArtifactWireError`` (malformed, truncated, bytes after the request) and
    ``trio.TooSlowError`` (not all within ``timeout_s``)."""
    with trio.fail_after(timeout_s):
        while data := await stream.receive_some():
            reader.feed(data)
    reader.eof()  # raises unless the whole request (and any trailer begun) arrived
    assert reader.request is not None  # eof() said so
    return reader.request
