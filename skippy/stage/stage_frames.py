"""Stage frames (skippy-stage/2, stream kind 0x02): the frames that carry a request between stages.

Sans-IO: bytes in, frames out; frames in, bytes out. No sockets, tasks or clocks (the mesh
shell, ``mesh_node.serving``, moves the bytes). Skippy owns this framing (spec "Peer Cache
Transfer": "Mesh owns only the subprotocol open envelope").

One stream carries one session between two consecutive stages (stage i -> stage i+1), and one
"return" stream carries the sampled token ids from the final stage straight back to stage 0.
A frame is a fixed 40-byte little-endian header and a payload whose size follows from the
header alone::

    version u8 | kind u8 | phase u8 | flags u8 | request_id u64 | session_id u64 |
    start u32 | count u32 | width u32 | reserved u32 (0)

    BEGIN        width = the link's activation width; payload BEGIN_PAYLOAD:
                 temperature f64 | top_p f64 | top_k u32 | reserved u32 | seed u64 |
                 topology_id 128 bytes ASCII, NUL-padded; count 0, or with flag CONTROLS
                 (only to a peer advertising ``sampling-controls``) then CONTROLS_FIXED:
                 min_p f64 | typical_p f64 | repeat_penalty f64 | presence_penalty f64 |
                 frequency_penalty f64 | repeat_last_n u32 | reserved u32, and count
                 logit-bias entries: token u32 | bias f64; flag DRAFTS (only through peers
                 advertising ``nextn-drafts``): the final stage drafts with its NextN head
    ACTIVATIONS  count tokens at positions start..start+count, payload raw LE f32
                 [count x width]; phase prefill (any count) or decode (count 1); flag SAMPLE:
                 the final stage samples a token after this frame's last row; flag IDS: the
                 rows are followed by the count token ids (u32) they are the activations of
                 (a session whose penalties read the tokens before each sampled position
                 sends every frame so; every stage passes them on)
    ACK          the receiver has taken the frame at ``start`` (early acknowledgement: sent
                 on receipt, before computing it); no payload
                 phase verify (only to a peer advertising ``verify-window``):
                 a speculative verify window, count = 1 + drafted tokens at start..start+count,
                 payload the rows then the window's count token ids (u32: the committed token
                 and the drafts) so the final stage can accept; flag SAMPLE required. The next
                 frame of the session may start anywhere in start+1..start+count (the
                 receiver truncates its KV there: the rejected drafts)
    TOKENS       count sampled token ids, payload count x u32; width 0 (final -> stage 0);
                 after a verify window, the accepted drafts and the target's next token;
                 flag DRAFTS (a session that asked for them): the last id is the final
                 stage's NextN draft for the position after the others, not a sampled token
    FREE         stop/cancel: free the session's KV cache here and pass it on; no payload
    RETURN       the first frame of a return stream (final -> stage 0); no payload

The receiver computes the payload size from the header and *its own* width and refuses
anything else (``FrameDecoder``), and checks the order of a session's frames
(``SessionInbound``): BEGIN first, contiguous positions, one session per stream. Every
refusal is a ``TransportError`` with a stable code; the shell resets that one stream with
it, so other sessions never notice.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum, IntFlag
from typing import Final

import numpy as np
import numpy.typing as npt

from skippy.errors import SkippyError, UsageError
from skippy.runtime.sampling import MAX_LOGIT_BIAS_TOKENS, SamplingParams

VERSION: Final = 1
HEADER: Final = struct.Struct("<BBBBQQIIII")
HEADER_BYTES: Final = HEADER.size  # 40
_BEGIN_FIXED: Final = struct.Struct("<ddIIQ")
TOPOLOGY_ID_BYTES: Final = 128
BEGIN_PAYLOAD_BYTES: Final = _BEGIN_FIXED.size + TOPOLOGY_ID_BYTES  # 160
_CONTROLS_FIXED: Final = struct.Struct("<dddddII")  # 48 bytes
_BIAS_ENTRY: Final = struct.Struct("<Id")  # 12 bytes
F32_BYTES: Final = 4
TOKEN_BYTES: Final = 4
MAX_U32: Final = 0xFFFFFFFF
MAX_U64: Final = (1 << 64) - 1
_TOPOLOGY_ID_RE: Final = re.compile(rb"\A[A-Za-z0-9][A-Za-z0-9._:-]{0,127}\Z")

# Defaults of the per-link caps (``TransportLimits``).
DEFAULT_MAX_FRAME_BYTES: Final = 8 * 1024 * 1024
DEFAULT_MAX_FRAME_TOKENS: Final = 4096
DEFAULT_MAX_INFLIGHT_FRAMES: Final = 4


class TransportError(SkippyError, ValueError):
    """A transport frame (or a frame's place in its session) is refused; ``code`` says why."""

    code = "transport_error"


class Kind(IntEnum):
    BEGIN = 1
    ACTIVATIONS = 2
    ACK = 3
    TOKENS = 4
    FREE = 5
    RETURN = 6


class Phase(IntEnum):
    PREFILL = 0
    DECODE = 1
    VERIFY = 2  # a speculative verify window (feature bit ``verify-window``)


class Flag(IntFlag):
    NONE = 0
    SAMPLE = 1  # the final stage samples a token after this frame's last row
    IDS = 2  # ACTIVATIONS: the rows' token ids follow them (feature bit sampling-controls)
    CONTROLS = 4  # BEGIN: the sampling controls and logit bias follow (sampling-controls)
    # BEGIN: the final stage drafts with its NextN head (nextn-drafts); TOKENS: the last id
    # is that draft
    DRAFTS = 8


KNOWN_FLAGS: Final = int(Flag.SAMPLE | Flag.IDS | Flag.CONTROLS | Flag.DRAFTS)
# What the final stage samples with: the request's values and seed (``sampler_at`` derives
# each position's generator seed from it).
Sampling = SamplingParams


@dataclass(frozen=True)
class TransportLimits:
    """Caps a receiver enforces (and a sender respects): bytes and tokens per frame, and frames
    a sender may have unacknowledged on one link."""

    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    max_frame_tokens: int = DEFAULT_MAX_FRAME_TOKENS
    max_inflight_frames: int = DEFAULT_MAX_INFLIGHT_FRAMES

    def __post_init__(self) -> None:
        for name in ("max_frame_bytes", "max_frame_tokens", "max_inflight_frames"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_U32:
                raise TransportError(f"{name} must be in 1..{MAX_U32}", code="transport_limits")

    def tokens_per_frame(self, width: int) -> int:
        """The most activation rows one frame may carry at ``width``."""
        return max(1, min(self.max_frame_tokens, self.max_frame_bytes // (width * F32_BYTES)))


@dataclass(frozen=True)
class Frame:
    kind: Kind
    request_id: int
    session_id: int
    phase: Phase = Phase.PREFILL
    flags: Flag = Flag.NONE
    start: int = 0
    count: int = 0
    width: int = 0
    # A view of the received bytes where the frame lay whole in one immutable chunk (no copy).
    payload: bytes | memoryview = field(default=b"", repr=False)

    # --- typed views of the payload ------------------------------------------------------------
    def activations(self) -> npt.NDArray[np.float32]:
        """``[count x width]`` f32 (read-only view of the payload)."""
        if self.kind is not Kind.ACTIVATIONS:
            raise TransportError("not an activations frame", code="transport_wrong_kind")
        rows = np.frombuffer(self.payload, dtype="<f4", count=self.count * self.width)
        return rows.reshape(self.count, self.width)

    def tokens(self) -> list[int]:
        """The token ids of a TOKENS frame, or the rows' ids of a verify frame or of an
        activations frame with flag IDS."""
        if self.kind is Kind.ACTIVATIONS and self.carries_ids:
            rows = self.count * self.width * F32_BYTES
            return [int(t) for t in np.frombuffer(self.payload, dtype="<u4", offset=rows)]
        if self.kind is not Kind.TOKENS:
            raise TransportError("not a tokens frame", code="transport_wrong_kind")
        return [int(t) for t in np.frombuffer(self.payload, dtype="<u4")]

    def sampled(self) -> tuple[list[int], int | None]:
        """A TOKENS frame's sampled token ids, and the NextN draft after them (flag DRAFTS)
        or None."""
        ids = self.tokens()
        if self.flags & Flag.DRAFTS:
            return ids[:-1], ids[-1]
        return ids, None

    @property
    def wants_drafts(self) -> bool:
        """A BEGIN frame asking the final stage for NextN drafts."""
        return self.kind is Kind.BEGIN and bool(self.flags & Flag.DRAFTS)

    @property
    def carries_ids(self) -> bool:
        """An activations frame whose rows' token ids follow them."""
        return self.phase is Phase.VERIFY or bool(self.flags & Flag.IDS)

    def begin(self) -> tuple[Sampling, str]:
        """(sampling, topology id) of a BEGIN frame."""
        if self.kind is not Kind.BEGIN:
            raise TransportError("not a begin frame", code="transport_wrong_kind")
        return _check_begin(bytes(self.payload), self.count)


# --- encoding ----------------------------------------------------------------------------------
def _header(
    kind: Kind,
    request_id: int,
    session_id: int,
    *,
    phase: Phase = Phase.PREFILL,
    flags: Flag = Flag.NONE,
    start: int = 0,
    count: int = 0,
    width: int = 0,
) -> bytes:
    for name, value, hi in (
        ("request_id", request_id, MAX_U64),
        ("session_id", session_id, MAX_U64),
        ("start", start, MAX_U32),
        ("count", count, MAX_U32),
        ("width", width, MAX_U32),
    ):
        if not 0 <= value <= hi:
            raise TransportError(f"{name} {value} does not fit its field", code="transport_range")
    return HEADER.pack(
        VERSION, kind, phase, int(flags), request_id, session_id, start, count, width, 0
    )


def encode_begin(
    request_id: int,
    session_id: int,
    *,
    width: int,
    sampling: Sampling,
    topology_id: str,
    drafts: bool = False,
) -> bytes:
    """A session's first frame. Sampling controls beyond temperature, top-k, top-p and the
    seed (``Sampling.controls``) add the CONTROLS block; without them the frame is the one
    every version reads. ``drafts`` asks the final stage for NextN drafts (flag DRAFTS)."""
    extra = Flag.DRAFTS if drafts else Flag.NONE
    raw_id = topology_id.encode("ascii")
    if not _TOPOLOGY_ID_RE.match(raw_id):
        raise TransportError(f"topology id {topology_id!r} is not valid", code="transport_range")
    body = _BEGIN_FIXED.pack(
        sampling.temperature, sampling.top_p, sampling.top_k, 0, sampling.seed
    ) + raw_id.ljust(TOPOLOGY_ID_BYTES, b"\0")
    if not sampling.controls:
        return _header(Kind.BEGIN, request_id, session_id, flags=extra, width=width) + body
    controls = _CONTROLS_FIXED.pack(
        sampling.min_p,
        sampling.typical_p,
        sampling.repeat_penalty,
        sampling.presence_penalty,
        sampling.frequency_penalty,
        sampling.repeat_last_n,
        0,
    ) + b"".join(_BIAS_ENTRY.pack(token, bias) for token, bias in sampling.logit_bias)
    head = _header(
        Kind.BEGIN,
        request_id,
        session_id,
        flags=Flag.CONTROLS | extra,
        count=len(sampling.logit_bias),
        width=width,
    )
    return head + body + controls


def encode_activations(
    request_id: int,
    session_id: int,
    *,
    phase: Phase,
    start: int,
    activations: npt.NDArray[np.float32],
    flags: Flag = Flag.NONE,
    tokens: Sequence[int] | None = None,
) -> bytes:
    """An activations frame; with ``tokens`` (one id per row) flag IDS and the ids after the
    rows (a verify window always carries them: ``encode_verify``)."""
    rows = np.ascontiguousarray(activations, dtype="<f4")
    if rows.ndim != 2 or rows.shape[0] == 0:
        raise TransportError("activations must be [tokens x width]", code="transport_range")
    count, width = int(rows.shape[0]), int(rows.shape[1])
    ids = b""
    if tokens is not None:
        ids = _token_ids(tokens, count)
        if phase is not Phase.VERIFY:
            flags |= Flag.IDS
    elif flags & Flag.IDS or phase is Phase.VERIFY:
        raise TransportError("this frame needs its rows' token ids", code="transport_range")
    head = _header(
        Kind.ACTIVATIONS,
        request_id,
        session_id,
        phase=phase,
        flags=flags,
        start=start,
        count=count,
        width=width,
    )
    return b"".join((head, rows.data.cast("B"), ids))  # one copy of the rows


def _token_ids(tokens: Sequence[int], rows: int) -> bytes:
    ids = np.asarray(list(tokens), dtype=np.int64)
    if ids.size != rows:
        raise TransportError(
            "a frame's token ids are one per activation row", code="transport_range"
        )
    if (ids < 0).any() or (ids > MAX_U32).any():
        raise TransportError("token ids must be u32 values", code="transport_range")
    return ids.astype("<u4").tobytes()


def encode_verify(
    request_id: int,
    session_id: int,
    *,
    start: int,
    activations: npt.NDArray[np.float32],
    tokens: Sequence[int],
) -> bytes:
    """A verify window: activations ``[count x width]`` for positions ``start..start+count``
    and the window's ``count`` token ids (the committed token, then the drafts)."""
    return encode_activations(
        request_id,
        session_id,
        phase=Phase.VERIFY,
        start=start,
        activations=activations,
        flags=Flag.SAMPLE,
        tokens=tokens,
    )


def encode_ack(request_id: int, session_id: int, *, start: int, count: int) -> bytes:
    return _header(Kind.ACK, request_id, session_id, start=start, count=count)


def encode_tokens(
    request_id: int,
    session_id: int,
    *,
    start: int,
    tokens: Sequence[int],
    draft: int | None = None,
) -> bytes:
    """Sampled ``tokens`` from ``start`` on, and the NextN ``draft`` after them (flag
    DRAFTS) where the session asked for drafts and the head made one."""
    listed = list(tokens)
    if not listed:
        raise TransportError("token ids must be 1+ values in u32", code="transport_range")
    ids = np.asarray(listed + ([draft] if draft is not None else []), dtype=np.int64)
    if (ids < 0).any() or (ids > MAX_U32).any():
        raise TransportError("token ids must be 1+ values in u32", code="transport_range")
    flags = Flag.DRAFTS if draft is not None else Flag.NONE
    return _header(
        Kind.TOKENS, request_id, session_id, flags=flags, start=start, count=int(ids.size)
    ) + ids.astype("<u4").tobytes()


def encode_free(request_id: int, session_id: int) -> bytes:
    return _header(Kind.FREE, request_id, session_id)


def encode_return(request_id: int, session_id: int) -> bytes:
    return _header(Kind.RETURN, request_id, session_id)


# --- decoding ----------------------------------------------------------------------------------
def _refuse(code: str, message: str, **kw: object) -> TransportError:
    return TransportError(message, code=code, **kw)  # type: ignore[arg-type]


class FrameDecoder:
    """Bytes of one stream in, whole frames out. ``width`` is this receiver's own activation
    width (0 for a stream that carries no activations, e.g. a return stream). A violation
    raises ``TransportError`` and the decoder is then unusable (the stream must be reset)."""

    def __init__(self, *, width: int, limits: TransportLimits | None = None) -> None:
        self.width = width
        self.limits = limits or TransportLimits()
        self._buf = bytearray()
        self._head: tuple[int, ...] | None = None
        self._need = HEADER_BYTES
        self._failed = False

    @property
    def buffered(self) -> int:
        return len(self._buf)

    def feed(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        if self._failed:
            raise _refuse("transport_failed", "the stream already failed")
        frames: list[Frame] = []
        try:
            if not self._buf and self._head is None and type(data) is bytes:
                done = self._whole_frames(data, frames)
                if done == len(data):
                    return frames
                data = memoryview(data)[done:]
            self._buf += data
            while len(self._buf) >= self._need:
                if self._head is None:
                    self._head = HEADER.unpack_from(self._buf)
                    del self._buf[:HEADER_BYTES]
                    self._need = self._payload_size(self._head)
                    if self._need > 0:
                        continue
                frames.append(self._frame(self._head, bytes(self._buf[: self._need])))
                del self._buf[: self._need]
                self._head, self._need = None, HEADER_BYTES
        except TransportError:
            self._failed = True
            raise
        return frames

    def _whole_frames(self, data: bytes, frames: list[Frame]) -> int:
        """Append the frames lying wholly in ``data`` (immutable: payloads are views of it,
        not copies; a decode step's activations then reach the stage with no copy before
        ggml's own); return where the rest begins."""
        view, off, size = memoryview(data), 0, len(data)
        while size - off >= HEADER_BYTES:
            head = HEADER.unpack_from(data, off)
            end = off + HEADER_BYTES + self._payload_size(head)
            if end > size:
                break
            frames.append(self._frame(head, view[off + HEADER_BYTES : end]))
            off = end
        return off

    def eof(self) -> None:
        """The stream ended: refuse a frame cut short."""
        if self._buf or self._head is not None:
            self._failed = True
            raise _refuse("transport_truncated", "the stream ended inside a frame")

    def _payload_size(self, head: tuple[int, ...]) -> int:
        version, kind, phase, flags, _rid, _sid, _start, count, width, reserved = head
        if version != VERSION:
            raise _refuse(
                "transport_version", f"frame version {version}, expected {VERSION}", actual=version
            )
        if kind not in Kind.__members__.values():
            raise _refuse("transport_unknown_kind", f"unknown frame kind {kind}", actual=kind)
        if phase not in Phase.__members__.values():
            raise _refuse("transport_bad_phase", f"unknown phase {phase}", actual=phase)
        if flags & ~KNOWN_FLAGS or reserved != 0:
            raise _refuse("transport_bad_flags", "unknown flags or non-zero reserved field")
        kind = Kind(kind)
        lim = self.limits
        if flags & Flag.IDS and (kind is not Kind.ACTIVATIONS or phase == Phase.VERIFY):
            raise _refuse("transport_bad_flags", f"flag IDS on a {kind.name} frame")
        if flags & Flag.CONTROLS and kind is not Kind.BEGIN:
            raise _refuse("transport_bad_flags", f"flag CONTROLS on a {kind.name} frame")
        if flags & Flag.DRAFTS and kind not in (Kind.BEGIN, Kind.TOKENS):
            raise _refuse("transport_bad_flags", f"flag DRAFTS on a {kind.name} frame")
        if kind is Kind.ACTIVATIONS:
            if width != self.width or self.width == 0:
                raise _refuse(
                    "transport_width_mismatch",
                    f"activations of width {width}; this stage takes width {self.width}",
                    expected=self.width,
                    actual=width,
                )
            if phase == Phase.VERIFY and not flags & Flag.SAMPLE:
                raise _refuse("transport_bad_flags", "a verify window must ask for sampling")
            if not 1 <= count <= lim.max_frame_tokens or (phase == Phase.DECODE and count != 1):
                raise _refuse(
                    "transport_bad_count",
                    f"{count} tokens in one {Phase(phase).name.lower()} frame "
                    f"(1..{lim.max_frame_tokens}; decode: 1)",
                    actual=count,
                )
            size = count * self.width * F32_BYTES
            if phase == Phase.VERIFY or flags & Flag.IDS:
                size += count * TOKEN_BYTES  # the rows' token ids after them
            if size > lim.max_frame_bytes:
                raise _refuse(
                    "transport_frame_too_large",
                    f"a frame of {size} bytes; the cap is {lim.max_frame_bytes}",
                    expected=lim.max_frame_bytes,
                    actual=size,
                )
            return size
        if kind is Kind.TOKENS:
            least = 2 if flags & Flag.DRAFTS else 1  # a draft follows at least one token
            if width != 0 or not least <= count <= lim.max_frame_tokens:
                raise _refuse("transport_bad_count", f"{count} token ids of width {width}")
            return count * TOKEN_BYTES
        if kind is Kind.BEGIN:
            if width != self.width:
                raise _refuse(
                    "transport_width_mismatch",
                    f"a session of width {width}; this stage takes width {self.width}",
                    expected=self.width,
                    actual=width,
                )
            if not flags & Flag.CONTROLS:
                if count != 0:
                    raise _refuse("transport_bad_count", "a BEGIN without controls has count 0")
                return BEGIN_PAYLOAD_BYTES
            if count > MAX_LOGIT_BIAS_TOKENS:
                raise _refuse(
                    "transport_bad_count",
                    f"{count} logit-bias entries (at most {MAX_LOGIT_BIAS_TOKENS})",
                    actual=count,
                )
            return BEGIN_PAYLOAD_BYTES + _CONTROLS_FIXED.size + count * _BIAS_ENTRY.size
        if kind is not Kind.ACK and (count != 0 or width != 0):
            raise _refuse("transport_bad_count", f"a {kind.name} frame carries no tokens")
        return 0

    def _frame(self, head: tuple[int, ...], payload: bytes | memoryview) -> Frame:
        _v, kind, phase, flags, rid, sid, start, count, width, _r = head
        frame = Frame(Kind(kind), rid, sid, Phase(phase), Flag(flags), start, count, width, payload)
        if frame.kind is Kind.BEGIN:
            _check_begin(bytes(payload), count)
        return frame


def _check_begin(payload: bytes, count: int) -> tuple[Sampling, str]:
    """(sampling, topology id) of a BEGIN payload; ``count`` logit-bias entries follow the
    controls block when the payload is longer than the fixed part."""
    temperature, top_p, top_k, reserved, seed = _BEGIN_FIXED.unpack_from(payload)
    raw = payload[_BEGIN_FIXED.size : BEGIN_PAYLOAD_BYTES]
    tid = raw.rstrip(b"\0")
    if reserved != 0 or b"\0" in tid or not _TOPOLOGY_ID_RE.match(tid):
        raise _refuse("transport_bad_begin", "a begin frame with a malformed topology id")
    base = Sampling()
    min_p, typical_p, repeat, presence, frequency, last_n = (
        base.min_p,
        base.typical_p,
        base.repeat_penalty,
        base.presence_penalty,
        base.frequency_penalty,
        base.repeat_last_n,
    )
    bias: list[tuple[int, float]] = []
    if len(payload) > BEGIN_PAYLOAD_BYTES:
        min_p, typical_p, repeat, presence, frequency, last_n, reserved = (
            _CONTROLS_FIXED.unpack_from(payload, BEGIN_PAYLOAD_BYTES)
        )
        if reserved != 0:
            raise _refuse("transport_bad_begin", "a begin frame with a non-zero reserved field")
        at = BEGIN_PAYLOAD_BYTES + _CONTROLS_FIXED.size
        bias = [_BIAS_ENTRY.unpack_from(payload, at + i * _BIAS_ENTRY.size) for i in range(count)]
    try:
        sampling = Sampling(
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            min_p=min_p,
            typical_p=typical_p,
            repeat_penalty=repeat,
            presence_penalty=presence,
            frequency_penalty=frequency,
            repeat_last_n=last_n,
            logit_bias=tuple(bias),
        )
    except UsageError as exc:  # the values' own checks (ranges, bias ids ascending)
        raise _refuse("transport_bad_begin", f"a begin frame's sampling: {exc.message}") from None
    return sampling, tid.decode("ascii")


# --- a session's frames in order (pure) ----------------------------------------------------------
@dataclass
class SessionInbound:
    """The order rules of one inbound chain stream: exactly one BEGIN first, then ACTIVATIONS
    of that session at contiguous positions, then FREE (or the end of the stream). Anything
    else is refused (``unknown_session``, ``transport_out_of_order``, ``transport_position``).
    A session whose sampling has penalties needs its token ids in every activations frame
    (``transport_missing_ids``). ``max_positions`` is the receiving stage's context
    (``n_ctx``)."""

    max_positions: int
    session_id: int | None = None
    request_id: int | None = None
    position: int = 0
    freed: bool = False
    # after a verify window at s with count c: the next frame may start in s+1..s+c
    rewind_floor: int | None = None
    ids_required: bool = False  # the BEGIN's penalties read the tokens before each position

    def accept(self, frame: Frame) -> None:
        if self.freed:
            raise _refuse("transport_out_of_order", "a frame after the session was freed")
        if frame.kind is Kind.BEGIN:
            if self.session_id is not None:
                raise _refuse("transport_out_of_order", "a second begin on one stream")
            self.session_id, self.request_id = frame.session_id, frame.request_id
            self.ids_required = frame.begin()[0].penalized
            return
        if self.session_id is None or frame.session_id != self.session_id:
            raise _refuse(
                "unknown_session",
                f"a {frame.kind.name} frame for session {frame.session_id:#x}, which this "
                "stream did not begin",
                actual=frame.session_id,
            )
        if frame.kind is Kind.FREE:
            self.freed = True
            return
        if frame.kind is not Kind.ACTIVATIONS:
            raise _refuse(
                "transport_out_of_order", f"a {frame.kind.name} frame on a chain stream"
            )
        floor = self.rewind_floor if self.rewind_floor is not None else self.position
        if not floor <= frame.start <= self.position:
            raise _refuse(
                "transport_position",
                f"activations at position {frame.start}; the session holds {self.position}"
                + (
                    f" (after a verify window: {floor}..{self.position})"
                    if floor < self.position
                    else ""
                ),
                expected=self.position,
                actual=frame.start,
            )
        if self.ids_required and not frame.carries_ids:
            raise _refuse(
                "transport_missing_ids",
                "this session's penalties read its tokens: every activations frame carries "
                "their ids (flag IDS)",
            )
        if frame.start + frame.count > self.max_positions:
            raise _refuse(
                "context_full",
                f"the session would reach {frame.start + frame.count} positions; the context "
                f"holds {self.max_positions}",
                expected=self.max_positions,
                actual=frame.start + frame.count,
            )
        self.position = frame.start + frame.count
        self.rewind_floor = frame.start + 1 if frame.phase is Phase.VERIFY else None


@dataclass
class SessionTokens:
    """A session's token ids by position, as its frames carried them (flag IDS, verify
    windows), recorded in the order the stage computes the frames: what the penalties read
    before a sampled position (``window``: the last ``repeat_last_n``; 0 records nothing). A
    frame that starts inside what is recorded (the next frame after a verify window) replaces
    the positions from its start on."""

    window: int = 0
    ids: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, sampling: Sampling) -> SessionTokens:
        return cls(sampling.repeat_last_n if sampling.penalized else 0)

    def take(self, frame: Frame) -> None:
        if not self.window:
            return
        if not frame.carries_ids or frame.start > len(self.ids):
            raise _refuse(
                "transport_missing_ids",
                f"a frame at position {frame.start} without the token ids the penalties read",
            )
        del self.ids[frame.start :]
        self.ids.extend(frame.tokens())

    def before(self, position: int) -> list[int]:
        """The last ``window`` ids before ``position`` (all of them recorded)."""
        if not self.window:
            return []
        if position > len(self.ids):
            raise _refuse(
                "transport_missing_ids",
                f"sampling at position {position} needs the token ids before it; the session "
                f"has {len(self.ids)}",
            )
        return self.ids[max(0, position - self.window) : position]


def session_name(session_id: int) -> str:
    """The stage runtime's session id for a transport session (printable ASCII)."""
    return f"s{session_id:016x}"
