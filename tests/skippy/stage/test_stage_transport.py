"""The skippy-stage/2 transport frames (sans-IO): round trips, chunking, and hostile bytes."""

from __future__ import annotations

import itertools
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skippy.stage import stage_frames as t

WIDTH = 8
SAMPLING = t.Sampling(temperature=0.7, top_p=0.9, top_k=40, seed=123)


def _session_bytes(rows: list[int], *, width: int = WIDTH) -> tuple[bytes, list[np.ndarray]]:
    """A BEGIN, prefill frames of the given row counts, one decode frame, FREE."""
    rng = np.random.default_rng(len(rows))
    out = [t.encode_begin(7, 9, width=width, sampling=SAMPLING, topology_id="topo-abc")]
    arrays = []
    pos = 0
    for n in rows:
        a = rng.standard_normal((n, width)).astype(np.float32)
        arrays.append(a)
        out.append(t.encode_activations(7, 9, phase=t.Phase.PREFILL, start=pos, activations=a))
        pos += n
    d = rng.standard_normal((1, width)).astype(np.float32)
    arrays.append(d)
    out.append(
        t.encode_activations(
            7, 9, phase=t.Phase.DECODE, start=pos, activations=d, flags=t.Flag.SAMPLE
        )
    )
    out.append(t.encode_free(7, 9))
    return b"".join(out), arrays


def _decode_in_pieces(data: bytes, cuts: list[int], **kw: object) -> list[t.Frame]:
    dec = t.FrameDecoder(width=WIDTH, **kw)  # type: ignore[arg-type]
    frames: list[t.Frame] = []
    bounds = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    for lo, hi in itertools.pairwise(bounds):
        frames += dec.feed(data[lo:hi])
    dec.eof()
    return frames


@given(
    rows=st.lists(st.integers(1, 20), min_size=1, max_size=5),
    cuts=st.lists(st.integers(0, 10_000), max_size=12),
)
@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
def test_any_chunking_decodes_the_same_frames(rows: list[int], cuts: list[int]) -> None:
    data, arrays = _session_bytes(rows)
    frames = _decode_in_pieces(data, cuts)
    kinds = [f.kind for f in frames]
    assert kinds == [t.Kind.BEGIN] + [t.Kind.ACTIVATIONS] * (len(rows) + 1) + [t.Kind.FREE]
    assert frames[0].begin() == (SAMPLING, "topo-abc")
    for f, a in zip(frames[1:-1], arrays, strict=True):
        assert np.array_equal(f.activations(), a)  # raw LE f32: bit-exact
    assert frames[-2].phase is t.Phase.DECODE and frames[-2].flags & t.Flag.SAMPLE
    session = t.SessionInbound(max_positions=1000)
    for f in frames:
        session.accept(f)
    assert session.freed and session.position == sum(rows) + 1


def test_whole_frames_in_immutable_bytes_are_views_and_mutable_input_is_copied() -> None:
    """A frame lying whole in one received ``bytes`` chunk is a view of it (no copy before
    the stage's own); a mutable buffer (which its owner may reuse) is always copied."""
    rows = np.arange(2 * WIDTH, dtype=np.float32).reshape(2, WIDTH)
    data = t.encode_activations(1, 2, phase=t.Phase.PREFILL, start=0, activations=rows)
    (frame,) = t.FrameDecoder(width=WIDTH).feed(data)
    assert isinstance(frame.payload, memoryview) and frame.payload.obj is data
    assert np.array_equal(frame.activations(), rows)
    buf = bytearray(data)
    (copied,) = t.FrameDecoder(width=WIDTH).feed(buf)
    buf[t.HEADER_BYTES :] = bytes(len(buf) - t.HEADER_BYTES)  # the owner reuses its buffer
    assert np.array_equal(copied.activations(), rows)


@given(data=st.binary(max_size=400), cuts=st.lists(st.integers(0, 400), max_size=6))
@settings(max_examples=300)
def test_arbitrary_bytes_raise_only_transport_errors(data: bytes, cuts: list[int]) -> None:
    try:
        _decode_in_pieces(data, cuts)
    except t.TransportError as exc:
        assert exc.code.startswith("transport_")


@given(
    field=st.sampled_from(["version", "kind", "phase", "flags", "count", "width", "reserved"]),
    value=st.integers(0, 2**32 - 1),
)
@settings(max_examples=300)
def test_a_mutated_header_is_refused_or_means_the_same_size(field: str, value: int) -> None:
    """Whatever a peer writes into a header, the receiver never reads a payload of a size it
    did not derive from its own width and caps."""
    names = [
        "version", "kind", "phase", "flags", "rid", "sid", "start", "count", "width", "reserved"
    ]
    good = t.encode_activations(
        1, 2, phase=t.Phase.PREFILL, start=0, activations=np.zeros((3, WIDTH), np.float32)
    )
    head = list(t.HEADER.unpack_from(good))
    fmt = t.HEADER.format
    sizes = {"B": 0xFF, "Q": 2**64 - 1, "I": 2**32 - 1}
    i = names.index(field)
    head[i] = value & sizes[fmt[1:][i]]
    dec = t.FrameDecoder(width=WIDTH, limits=t.TransportLimits(max_frame_tokens=64))
    try:
        frames = dec.feed(t.HEADER.pack(*head) + good[t.HEADER_BYTES :])
    except t.TransportError:
        return
    for f in frames:
        if f.kind is t.Kind.ACTIVATIONS:
            ids = 4 * f.count if f.carries_ids else 0  # flag IDS: the rows' token ids follow
            assert f.width == WIDTH and len(f.payload) == f.count * WIDTH * 4 + ids
            assert 1 <= f.count <= 64
        elif f.kind is t.Kind.TOKENS:
            assert len(f.payload) == 4 * f.count


def test_width_other_than_the_receivers_is_refused() -> None:
    data = t.encode_activations(
        1, 2, phase=t.Phase.PREFILL, start=0, activations=np.zeros((2, WIDTH + 1), np.float32)
    )
    with pytest.raises(t.TransportError) as err:
        t.FrameDecoder(width=WIDTH).feed(data)
    assert err.value.code == "transport_width_mismatch"
    begin = t.encode_begin(1, 2, width=WIDTH * 2, sampling=SAMPLING, topology_id="x")
    with pytest.raises(t.TransportError) as err:
        t.FrameDecoder(width=WIDTH).feed(begin)
    assert err.value.code == "transport_width_mismatch"


def test_oversized_frames_are_refused_from_the_header_alone() -> None:
    limits = t.TransportLimits(max_frame_bytes=4 * WIDTH * 10, max_frame_tokens=1000)
    dec = t.FrameDecoder(width=WIDTH, limits=limits)
    # only the header: the decoder refuses before any payload byte arrives
    head = t.HEADER.pack(t.VERSION, t.Kind.ACTIVATIONS, 0, 0, 1, 2, 0, 11, WIDTH, 0)
    with pytest.raises(t.TransportError) as err:
        dec.feed(head)
    assert err.value.code == "transport_frame_too_large"
    huge = t.HEADER.pack(t.VERSION, t.Kind.ACTIVATIONS, 0, 0, 1, 2, 0, 2**32 - 1, WIDTH, 0)
    with pytest.raises(t.TransportError) as err:
        t.FrameDecoder(width=WIDTH).feed(huge)
    assert err.value.code == "transport_bad_count"
    assert limits.tokens_per_frame(WIDTH) == 10


def test_decode_frames_carry_one_token() -> None:
    head = t.HEADER.pack(t.VERSION, t.Kind.ACTIVATIONS, t.Phase.DECODE, 0, 1, 2, 0, 2, WIDTH, 0)
    with pytest.raises(t.TransportError) as err:
        t.FrameDecoder(width=WIDTH).feed(head)
    assert err.value.code == "transport_bad_count"


def test_a_truncated_stream_is_refused_at_eof() -> None:
    data, _ = _session_bytes([3])
    dec = t.FrameDecoder(width=WIDTH)
    dec.feed(data[:-5])
    with pytest.raises(t.TransportError) as err:
        dec.eof()
    assert err.value.code == "transport_truncated"
    with pytest.raises(t.TransportError):
        dec.feed(b"")  # a failed decoder stays failed


def test_begin_payload_is_checked() -> None:
    good = t.encode_begin(1, 2, width=WIDTH, sampling=SAMPLING, topology_id="topo-1")
    bad_t = bytearray(good)
    struct.pack_into("<d", bad_t, t.HEADER_BYTES, float("nan"))
    bad_id = bytearray(good)
    bad_id[t.HEADER_BYTES + 40] = 0x20  # a space inside the topology id
    for bad in (bad_t, bad_id):
        with pytest.raises(t.TransportError) as err:
            t.FrameDecoder(width=WIDTH).feed(bytes(bad))
        assert err.value.code == "transport_bad_begin"


def test_session_order_rules() -> None:
    acts = np.zeros((2, WIDTH), np.float32)
    begin = t.FrameDecoder(width=WIDTH).feed(
        t.encode_begin(1, 5, width=WIDTH, sampling=SAMPLING, topology_id="x")
    )[0]

    def act(session: int, start: int) -> t.Frame:
        data = t.encode_activations(
            1, session, phase=t.Phase.PREFILL, start=start, activations=acts
        )
        return t.FrameDecoder(width=WIDTH).feed(data)[0]

    s = t.SessionInbound(max_positions=4)
    with pytest.raises(t.TransportError) as err:
        s.accept(act(5, 0))  # before BEGIN
    assert err.value.code == "unknown_session"
    s.accept(begin)
    with pytest.raises(t.TransportError) as err:
        s.accept(act(6, 0))  # another session on this stream
    assert err.value.code == "unknown_session"
    with pytest.raises(t.TransportError) as err:
        s.accept(act(5, 1))
    assert err.value.code == "transport_position"
    s.accept(act(5, 0))
    s.accept(act(5, 2))
    with pytest.raises(t.TransportError) as err:
        s.accept(act(5, 4))
    assert err.value.code == "context_full"
    with pytest.raises(t.TransportError) as err:
        s.accept(begin)
    assert err.value.code == "transport_out_of_order"


def test_tokens_round_trip() -> None:
    f = t.FrameDecoder(width=0).feed(t.encode_tokens(3, 4, start=17, tokens=[0, 262143]))[0]
    assert f.tokens() == [0, 262143] and f.start == 17
    with pytest.raises(t.TransportError):
        t.encode_tokens(3, 4, start=0, tokens=[-1])


def test_a_nextn_draft_rides_after_the_sampled_tokens() -> None:
    """native-mtp: a BEGIN with flag DRAFTS asks the final stage for its NextN draft, which
    a TOKENS frame carries after the sampled tokens (flag DRAFTS); without one, the frame is
    the one every version reads."""
    begin = t.encode_begin(1, 2, width=WIDTH, sampling=SAMPLING, topology_id="x", drafts=True)
    (b,) = t.FrameDecoder(width=WIDTH).feed(begin)
    assert b.wants_drafts and b.begin()[1] == "x"
    plain = t.encode_begin(1, 2, width=WIDTH, sampling=SAMPLING, topology_id="x")
    assert not t.FrameDecoder(width=WIDTH).feed(plain)[0].wants_drafts
    rich = t.encode_begin(1, 2, width=WIDTH, sampling=CONTROLS, topology_id="x", drafts=True)
    (c,) = t.FrameDecoder(width=WIDTH).feed(rich)
    assert c.wants_drafts and c.begin()[0] == CONTROLS
    data = t.encode_tokens(3, 4, start=17, tokens=[5, 6], draft=262143)
    (f,) = t.FrameDecoder(width=0).feed(data)
    assert f.sampled() == ([5, 6], 262143) and f.flags & t.Flag.DRAFTS and f.count == 3
    assert t.encode_tokens(3, 4, start=17, tokens=[5, 6], draft=None) == t.encode_tokens(
        3, 4, start=17, tokens=[5, 6]
    )
    (one_token,) = t.FrameDecoder(width=0).feed(t.encode_tokens(3, 4, start=1, tokens=[9]))
    assert one_token.sampled() == ([9], None)
    head = list(t.HEADER.unpack_from(data))
    head[7] = 1  # a draft with no sampled token before it
    with pytest.raises(t.TransportError) as err:
        t.FrameDecoder(width=0).feed(t.HEADER.pack(*head) + data[t.HEADER_BYTES :][:4])
    assert err.value.code == "transport_bad_count"
    one = np.zeros((1, WIDTH), np.float32)
    act = bytearray(t.encode_activations(1, 2, phase=t.Phase.DECODE, start=0, activations=one))
    act[3] |= int(t.Flag.DRAFTS)  # flag DRAFTS on an activations frame
    with pytest.raises(t.TransportError) as err:
        t.FrameDecoder(width=WIDTH).feed(bytes(act))
    assert err.value.code == "transport_bad_flags"
    with pytest.raises(t.TransportError):
        t.encode_tokens(3, 4, start=0, tokens=[], draft=5)  # a draft needs a sampled token


# --- verify windows ------------------------------------------------------------------
def test_a_verify_window_round_trips_its_rows_and_token_ids() -> None:
    rows = np.arange(3 * WIDTH, dtype=np.float32).reshape(3, WIDTH)
    data = t.encode_verify(7, 9, start=12, activations=rows, tokens=[5, 6, 262143])
    assert len(data) == t.HEADER_BYTES + 3 * WIDTH * 4 + 3 * 4
    f = t.FrameDecoder(width=WIDTH).feed(data)[0]
    assert f.phase is t.Phase.VERIFY and f.flags & t.Flag.SAMPLE and (f.start, f.count) == (12, 3)
    assert np.array_equal(f.activations(), rows) and f.tokens() == [5, 6, 262143]
    with pytest.raises(t.TransportError):
        t.encode_verify(7, 9, start=0, activations=rows, tokens=[1, 2])  # one id per row


def test_a_verify_window_without_sampling_is_refused() -> None:
    good = t.encode_verify(
        1, 2, start=0, activations=np.zeros((2, WIDTH), np.float32), tokens=[1, 2]
    )
    head = list(t.HEADER.unpack_from(good))
    head[3] = 0  # flags
    with pytest.raises(t.TransportError) as err:
        t.FrameDecoder(width=WIDTH).feed(t.HEADER.pack(*head) + good[t.HEADER_BYTES :])
    assert err.value.code == "transport_bad_flags"


def test_after_a_verify_window_the_next_frame_may_rewind_into_it_only() -> None:
    dec = t.FrameDecoder(width=WIDTH)
    s = t.SessionInbound(max_positions=64)
    s.accept(dec.feed(t.encode_begin(1, 5, width=WIDTH, sampling=SAMPLING, topology_id="x"))[0])
    one = np.zeros((1, WIDTH), np.float32)

    def frame(start: int, n: int, verify: bool) -> t.Frame:
        acts = np.zeros((n, WIDTH), np.float32)
        data = (
            t.encode_verify(1, 5, start=start, activations=acts, tokens=list(range(n)))
            if verify
            else t.encode_activations(1, 5, phase=t.Phase.DECODE, start=start, activations=one)
        )
        return dec.feed(data)[0]

    s.accept(
        dec.feed(
            t.encode_activations(
                1, 5, phase=t.Phase.PREFILL, start=0, activations=np.zeros((10, WIDTH), np.float32)
            )
        )[0]
    )
    s.accept(frame(10, 5, True))  # positions 10..14
    for bad in (10, 16):  # not past the window's committed token; not beyond it
        with pytest.raises(t.TransportError) as err:
            s.accept(frame(bad, 1, False))
        assert err.value.code == "transport_position"
    s.accept(frame(12, 4, True))  # two drafts accepted: rewind to 12, a new window
    s.accept(frame(16, 1, False))  # the whole window accepted: no rewind
    with pytest.raises(t.TransportError) as err:
        s.accept(frame(15, 1, False))  # only right after a verify window
    assert err.value.code == "transport_position"


# --- sampling controls: BEGIN with CONTROLS, activations with IDS --------------------------------
CONTROLS = t.Sampling(
    temperature=0.8,
    top_p=0.95,
    top_k=40,
    seed=99,
    min_p=0.05,
    typical_p=0.9,
    repeat_penalty=1.1,
    presence_penalty=0.5,
    frequency_penalty=-0.25,
    repeat_last_n=32,
    logit_bias=((0, -100.0), (17, 2.5), (262143, 0.125)),
)


@given(cuts=st.lists(st.integers(0, 10_000), max_size=12))
@settings(max_examples=100)
def test_a_session_with_controls_and_token_ids_decodes_in_any_chunking(cuts: list[int]) -> None:
    rows = np.arange(5 * WIDTH, dtype=np.float32).reshape(5, WIDTH)
    data = b"".join(
        (
            t.encode_begin(7, 9, width=WIDTH, sampling=CONTROLS, topology_id="topo-abc"),
            t.encode_activations(
                7, 9, phase=t.Phase.PREFILL, start=0, activations=rows[:4], tokens=[1, 2, 3, 4]
            ),
            t.encode_activations(
                7, 9, phase=t.Phase.DECODE, start=4, activations=rows[4:], flags=t.Flag.SAMPLE,
                tokens=[262143],
            ),
            t.encode_free(7, 9),
        )
    )
    frames = _decode_in_pieces(data, cuts)
    assert frames[0].begin() == (CONTROLS, "topo-abc")
    assert frames[0].flags == t.Flag.CONTROLS and frames[0].count == 3
    assert [f.tokens() for f in frames[1:3]] == [[1, 2, 3, 4], [262143]]
    assert np.array_equal(np.concatenate([f.activations() for f in frames[1:3]]), rows)
    assert frames[2].flags == t.Flag.SAMPLE | t.Flag.IDS
    session = t.SessionInbound(max_positions=64)
    for f in frames:
        session.accept(f)
    assert session.ids_required and session.freed


def test_a_begin_without_controls_is_the_frame_every_version_reads() -> None:
    """Only controls beyond temperature, top-k, top-p and the seed change the BEGIN: a plain
    request's sessions stay readable by nodes without the sampling-controls bit."""
    plain = t.encode_begin(1, 2, width=WIDTH, sampling=SAMPLING, topology_id="x")
    assert len(plain) == t.HEADER_BYTES + t.BEGIN_PAYLOAD_BYTES
    assert t.HEADER.unpack_from(plain)[3] == 0  # no flags
    assert len(t.encode_begin(1, 2, width=WIDTH, sampling=CONTROLS, topology_id="x")) == (
        t.HEADER_BYTES + t.BEGIN_PAYLOAD_BYTES + 48 + 3 * 12
    )


def test_bad_controls_and_misplaced_flags_are_refused() -> None:
    good = t.encode_begin(1, 2, width=WIDTH, sampling=CONTROLS, topology_id="x")
    controls_at = t.HEADER_BYTES + t.BEGIN_PAYLOAD_BYTES
    unsorted = bytearray(good)  # the second entry's id below the first's
    struct.pack_into("<I", unsorted, controls_at + 48 + 12, 0)
    penalty = bytearray(good)
    struct.pack_into("<d", penalty, controls_at + 16, 0.0)  # repeat_penalty 0
    reserved = bytearray(good)
    struct.pack_into("<I", reserved, controls_at + 44, 1)
    for bad in (unsorted, penalty, reserved):
        with pytest.raises(t.TransportError) as err:
            t.FrameDecoder(width=WIDTH).feed(bytes(bad))
        assert err.value.code == "transport_bad_begin"
    head = list(t.HEADER.unpack_from(good))
    head[7] = 1025  # more logit-bias entries than any request may have
    with pytest.raises(t.TransportError) as err:
        t.FrameDecoder(width=WIDTH).feed(t.HEADER.pack(*head))
    assert err.value.code == "transport_bad_count"
    head[3], head[7] = 0, 3  # entries without the CONTROLS flag
    with pytest.raises(t.TransportError) as err:
        t.FrameDecoder(width=WIDTH).feed(t.HEADER.pack(*head))
    assert err.value.code == "transport_bad_count"
    one = np.zeros((1, WIDTH), np.float32)
    for kind, phase, flags in (
        (t.Kind.ACTIVATIONS, t.Phase.PREFILL, t.Flag.CONTROLS),
        (t.Kind.ACTIVATIONS, t.Phase.VERIFY, t.Flag.SAMPLE | t.Flag.IDS),
        (t.Kind.BEGIN, t.Phase.PREFILL, t.Flag.IDS),
        (t.Kind.TOKENS, t.Phase.PREFILL, t.Flag.IDS),
    ):
        width = 0 if kind is t.Kind.TOKENS else WIDTH
        head = t.HEADER.pack(t.VERSION, kind, phase, flags, 1, 2, 0, 1, width, 0)
        with pytest.raises(t.TransportError) as err:
            t.FrameDecoder(width=width).feed(head)
        assert err.value.code == "transport_bad_flags", (kind, flags)
    with pytest.raises(t.TransportError):  # one id per row
        t.encode_activations(1, 2, phase=t.Phase.PREFILL, start=0, activations=one, tokens=[])
    with pytest.raises(t.TransportError):  # flag IDS without the ids
        t.encode_activations(
            1, 2, phase=t.Phase.PREFILL, start=0, activations=one, flags=t.Flag.IDS
        )


def test_a_penalized_session_needs_every_frames_token_ids() -> None:
    dec = t.FrameDecoder(width=WIDTH)
    s = t.SessionInbound(max_positions=64)
    s.accept(dec.feed(t.encode_begin(1, 5, width=WIDTH, sampling=CONTROLS, topology_id="x"))[0])
    acts = np.zeros((2, WIDTH), np.float32)
    bare = t.encode_activations(1, 5, phase=t.Phase.PREFILL, start=0, activations=acts)
    with pytest.raises(t.TransportError) as err:
        s.accept(dec.feed(bare)[0])
    assert err.value.code == "transport_missing_ids"
    dec = t.FrameDecoder(width=WIDTH)
    s = t.SessionInbound(max_positions=64)
    plain = t.Sampling(temperature=0.5, min_p=0.1)  # controls, but no penalties: no ids needed
    s.accept(dec.feed(t.encode_begin(1, 5, width=WIDTH, sampling=plain, topology_id="x"))[0])
    s.accept(dec.feed(bare)[0])


def test_session_tokens_give_the_penalty_window_and_follow_a_rewind() -> None:
    dec = t.FrameDecoder(width=WIDTH)

    def frame(start: int, ids: list[int], verify: bool = False) -> t.Frame:
        acts = np.zeros((len(ids), WIDTH), np.float32)
        data = (
            t.encode_verify(1, 5, start=start, activations=acts, tokens=ids)
            if verify
            else t.encode_activations(
                1, 5, phase=t.Phase.PREFILL, start=start, activations=acts, tokens=ids
            )
        )
        return dec.feed(data)[0]

    tokens = t.SessionTokens.of(t.Sampling(repeat_penalty=1.2, repeat_last_n=3))
    tokens.take(frame(0, [10, 11, 12, 13]))
    assert tokens.before(4) == [11, 12, 13] and tokens.before(2) == [10, 11]
    tokens.take(frame(4, [14, 15, 16], verify=True))  # a window: 14 committed, drafts 15, 16
    assert tokens.before(6) == [13, 14, 15]
    tokens.take(frame(5, [20]))  # draft 15 was rejected: the next frame starts there
    assert tokens.ids == [10, 11, 12, 13, 14, 20] and tokens.before(6) == [13, 14, 20]
    with pytest.raises(t.TransportError) as err:
        tokens.before(7)
    assert err.value.code == "transport_missing_ids"
    with pytest.raises(t.TransportError) as err:
        tokens.take(frame(9, [1]))  # a gap
    assert err.value.code == "transport_missing_ids"
    off = t.SessionTokens.of(t.Sampling(logit_bias=((1, 1.0),)))  # nothing reads the tokens
    off.take(frame(0, [1, 2]))
    assert off.ids == [] and off.before(2) == []

