"""The swarm source list: which topology members hold which of a stage's artifacts, with each
artifact's chunk digests (pure, no I/O, no signing keys).

Spec "Peer Cache Transfer" keeps inventories private: nodes never gossip what they hold. The
coordinator, which learns holdings from ready reports (a stage reported ready holds its
stage's verified artifacts), tells one worker, on request, who holds the artifacts of *its*
stage and nothing else. The list is bound to the topology (id, run, package, manifest
SHA-256), the requester and its stage, and signed by the coordinator's node key (the mesh
shell signs ``signed_bytes`` under ``SIG_DOMAIN_SWARM_SOURCES``); a worker checks it with
``check_source_list`` against the topology and manifest it already verified, so a holder
outside the topology, a file its stage does not need, or a size or SHA-256 that differs from
the manifest is refused before a byte is asked for.

Wire (the body of an accepted response on a kind 0x04 stream, ``skippy.transfer.wire``
framing): a msgpack map ``{gen, list: <bin: signed_bytes>, signature: <bin 64>}``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import msgpack

from skippy.errors import IntegrityError, UsageError
from skippy.package.manifest import PackageManifest
from skippy.package.topology import SplitTopology
from skippy.transfer.chunks import (
    DIGEST_BYTES,
    chain_fits,
    check_chain,
    check_chunk_bytes,
    chunk_count,
    pack_digests,
    unpack_digests,
)
from skippy.transfer.errors import ArtifactWireError
from skippy.transfer.partials import pack_bitmap, unpack_bitmap
from skippy.transfer.required import stage_refs
from skippy.transfer.siblings import sibling_refusal

SOURCES_GEN: Final = 1
MAX_SOURCE_LIST_BYTES: Final = 4 * 1024 * 1024  # digests of ~100 GB at 8 MiB chunks
MAX_HOLDERS: Final = 64  # per artifact
MAX_ARTIFACTS: Final = 4096
SIGNATURE_BYTES: Final = 64
_LIST_KEYS: Final = frozenset(
    {
        "gen",
        "topology_id",
        "run_id",
        "manifest_sha256",
        "stage_id",
        "requester_id",
        "chunk_bytes",
        "artifacts",
    }
)
_ENTRY_KEYS: Final = frozenset({"path", "sha256", "size", "digests", "holders"})
# ``partial-serve`` (``skippy.transfer.partials``): sent only to a requester that
# advertises it (older decoders take exactly the keys above): the requester's fetch order
# among its counterparts, and per holder the chunks it holds (nil: every chunk).
_PARTIAL_LIST_KEYS: Final = frozenset({"rank", "ranks"})
_PARTIAL_ENTRY_KEYS: Final = frozenset({"have", "busy"})
# ``chunk-chain`` (``skippy.transfer.sha256_chain``): sent, as ``chain: true``, only
# to a requester that advertises it: every entry's digests are then its SHA-256 chain.
_CHAIN_KEY: Final = "chain"
MAX_RANKS: Final = 64


@dataclass(frozen=True)
class ArtifactSources:
    """One artifact of the requester's stage: its declaration, its chunk digests (from the
    coordinator's verified copy) and the node ids (hex) that hold a verified copy."""

    path: str
    sha256: str
    size: int
    digests: tuple[bytes, ...]
    holders: tuple[str, ...]
    # ``partial-serve``: per holder (aligned with ``holders``) the chunks it has
    # verified, None for a holder of the whole file; empty: every holder holds it whole.
    have: tuple[frozenset[int] | None, ...] = ()
    # and the chunks it was fetching at its last report (aligned too; empty: none)
    busy: tuple[frozenset[int], ...] = ()

    def chunks_of(self, holder: str) -> frozenset[int] | None:
        """The chunks ``holder`` is listed with (None: all of them)."""
        if not self.have or holder not in self.holders:
            return None
        return self.have[self.holders.index(holder)]

    def busy_of(self, holder: str) -> frozenset[int]:
        """The chunks ``holder`` was fetching (a fetch waits for them rather than asking the
        coordinator for the same bytes)."""
        if not self.busy or holder not in self.holders:
            return frozenset()
        return self.busy[self.holders.index(holder)]


@dataclass(frozen=True)
class SourceList:
    topology_id: str
    run_id: str
    manifest_sha256: str
    stage_id: str
    requester_id: str  # hex, as the topology spells node ids
    chunk_bytes: int
    artifacts: tuple[ArtifactSources, ...]
    # ``partial-serve``: this requester's fetch order among the counterparts that
    # need the same files (``skippy.transfer.partials.fetch_order``); ``partial`` says the
    # list carries these fields (and each entry's ``have``) on the wire.
    rank: int = 0
    ranks: int = 1
    partial: bool = False
    # ``chunk-chain``: the digests are SHA-256 chains (``skippy.transfer.chunks``)
    chain: bool = False

    def by_path(self) -> dict[str, ArtifactSources]:
        return {a.path: a for a in self.artifacts}

    def signed_bytes(self) -> bytes:
        """The canonical bytes the coordinator signs (msgpack, fixed key order)."""
        entries = []
        for a in self.artifacts:
            entry: dict[str, Any] = {
                "path": a.path,
                "sha256": a.sha256,
                "size": a.size,
                "digests": pack_digests(a.digests),
                "holders": [bytes.fromhex(h) for h in a.holders],
            }
            if self.partial:
                count = chunk_count(a.size, self.chunk_bytes)
                entry["have"] = [
                    None if c is None else pack_bitmap(c, count)
                    for c in (a.have or (None,) * len(a.holders))
                ]
                entry["busy"] = [
                    pack_bitmap(b, count) if b else None
                    for b in (a.busy or (frozenset(),) * len(a.holders))
                ]
            entries.append(entry)
        body: dict[str, Any] = {
            "gen": SOURCES_GEN,
            "topology_id": self.topology_id,
            "run_id": self.run_id,
            "manifest_sha256": self.manifest_sha256,
            "stage_id": self.stage_id,
            "requester_id": bytes.fromhex(self.requester_id),
            "chunk_bytes": self.chunk_bytes,
            "artifacts": entries,
        }
        if self.partial:
            body["rank"], body["ranks"] = self.rank, self.ranks
        if self.chain:
            body[_CHAIN_KEY] = True
        packed: bytes = msgpack.packb(body, use_bin_type=True)
        return packed


def plan_sources(
    topology: SplitTopology,
    manifest: PackageManifest,
    requester_id: str,
    *,
    coordinator_id: str,
    ready: Iterable[str],
    servers: Iterable[str],
    digests: Mapping[str, tuple[bytes, ...]],
    chunk_bytes: int,
    siblings: Iterable[tuple[SplitTopology, Iterable[str]]] = (),
    partial_holders: Mapping[str, Mapping[str, frozenset[int]]] | None = None,
    rank: tuple[int, int] | None = None,
    busy_holders: Mapping[str, Mapping[str, frozenset[int]]] | None = None,
    chain: bool = False,
) -> SourceList:
    """The list for ``requester_id``'s stage (the coordinator's decision). ``ready``: the
    stage nodes whose ready report was accepted; ``servers``: the members that serve swarm
    requests (the coordinator among them when it does); ``digests``: by artifact SHA-256 (a
    file without digests is left out: the worker fetches it whole, coordinator then hub).
    A holder is a server that is the coordinator (first) or reported ready with a stage
    needing that file; the requester is never its own holder; only members appear.
    ``siblings``: this coordinator's other replicas' topologies with their ready
    nodes; those that are siblings of ``topology`` (``skippy.transfer.siblings``: same
    package and revision) add their ready servers as holders, after the members (a
    requester's own replica first). Pass them only when the requester takes such holders.

    ``partial_holders``, ``busy_holders`` and ``rank`` (``partial-serve``; pass
    them only when the requester advertises it, the list then carries them): node -> path ->
    the chunks it reported verified (``skippy.transfer.partials.check_have``; the caller
    keeps only servers of this topology or a sibling), and those it was fetching at a fresh
    report; such a node is listed after the whole-file holders with both sets (even before
    it verified a chunk: a fetch then waits for it rather than ask the coordinator for the
    same bytes); ``rank`` = (this requester's rank, counterparts) for its fetch order.
    ``chain`` (``chunk-chain``; only when the requester advertises it): ``digests``
    are SHA-256 chains, and the list says so."""
    stage = topology.stage_of(requester_id)
    if stage is None:
        raise IntegrityError(
            f"{requester_id[:12]} holds no stage in {topology.topology_id}",
            code="requester_not_in_topology",
        )
    serving = set(servers)
    held = _holders(manifest, topology, set(ready) & serving, requester_id)
    outside: dict[str, set[str]] = {}
    members = {s.node_id for s in topology.stages}
    for sibling, sibling_ready in siblings:
        if sibling_refusal(topology, sibling) is not None:
            continue
        found = _holders(manifest, sibling, set(sibling_ready) & serving, requester_id)
        for path, nodes in found.items():
            outside.setdefault(path, set()).update(nodes - members)
    first = [coordinator_id] if coordinator_id in serving and coordinator_id != requester_id else []
    entries = []
    for ref in stage_refs(manifest, stage.layers):
        sha = ref.artifact.sha256.lower()
        if sha not in digests:  # the coordinator has no verified copy: fetched whole
            continue
        others = sorted(held.get(ref.path, set()) - {coordinator_id})
        far = sorted(outside.get(ref.path, set()) - {coordinator_id})
        whole = [*first, *others, *far]
        partial_of = partial_holders or {}
        busy_of = busy_holders or {}
        partial = sorted(
            n
            for n in set(partial_of) | set(busy_of)
            if (ref.path in partial_of.get(n, {}) or ref.path in busy_of.get(n, {}))
            and n not in whole
            and n not in (requester_id, coordinator_id)
        )
        holders = tuple([*whole, *partial][:MAX_HOLDERS])
        have: tuple[frozenset[int] | None, ...] = ()
        busy: tuple[frozenset[int], ...] = ()
        if partial_holders is not None:
            have = tuple(
                None if h in whole else partial_of.get(h, {}).get(ref.path, frozenset())
                for h in holders
            )
            busy = tuple(busy_of.get(h, {}).get(ref.path, frozenset()) for h in holders)
        entries.append(
            ArtifactSources(
                ref.path, sha, ref.artifact.artifact_bytes, digests[sha], holders, have, busy
            )
        )
    ranked = rank is not None or partial_holders is not None
    own_rank, ranks = rank if rank is not None else (0, 1)
    return SourceList(
        topology.topology_id,
        topology.run_id,
        topology.manifest_sha256,
        stage.stage_id,
        requester_id,
        check_chunk_bytes(chunk_bytes),
        tuple(entries),
        rank=own_rank,
        ranks=ranks,
        partial=ranked,
        chain=chain,
    )


def _holders(
    manifest: PackageManifest, topology: SplitTopology, ready: set[str], requester_id: str
) -> dict[str, set[str]]:
    """Path -> the ``ready`` stage nodes of ``topology`` whose stage needs it."""
    held: dict[str, set[str]] = {}
    for other in topology.stages:
        if other.node_id == requester_id or other.node_id not in ready:
            continue
        for ref in stage_refs(manifest, other.layers):
            held.setdefault(ref.path, set()).add(other.node_id)
    return held


def required_set(manifest: PackageManifest, topology: SplitTopology, node_id: str) -> dict[
    str, tuple[str, int]
]:
    """``node_id``'s required set as ``check_source_list`` takes it."""
    stage = topology.stage_of(node_id)
    if stage is None:
        return {}
    return {
        r.path: (r.artifact.sha256.lower(), r.artifact.artifact_bytes)
        for r in stage_refs(manifest, stage.layers)
    }


# --- the wire -----------------------------------------------------------------------------
def encode_source_list(sources: SourceList, signature: bytes) -> bytes:
    """The response body: the signed bytes and the signature over them."""
    packed: bytes = msgpack.packb(
        {"gen": SOURCES_GEN, "list": sources.signed_bytes(), "signature": signature},
        use_bin_type=True,
    )
    return packed


def _bad(message: str) -> ArtifactWireError:
    return ArtifactWireError(message, code="source_list_malformed")


def _unpack(payload: bytes, max_map: int) -> Any:
    try:
        return msgpack.unpackb(
            payload,
            raw=False,
            strict_map_key=True,
            max_str_len=MAX_SOURCE_LIST_BYTES,
            max_bin_len=MAX_SOURCE_LIST_BYTES,
            max_array_len=max(MAX_ARTIFACTS, MAX_HOLDERS),
            max_map_len=max_map,
            max_ext_len=0,
        )
    except (ValueError, TypeError, OverflowError) as exc:
        raise _bad(f"a source list is not valid msgpack: {exc}") from None


def _field(data: Mapping[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise _bad(f"source list field {key!r} has the wrong type")
    return value


def decode_source_list(payload: bytes) -> tuple[SourceList, bytes, bytes]:
    """A response body -> (the list, the bytes that were signed, the signature). Only the
    shape is checked here; ``check_source_list`` binds it to what the requester knows."""
    if len(payload) > MAX_SOURCE_LIST_BYTES:
        raise _bad(f"a source list of {len(payload)} bytes is over {MAX_SOURCE_LIST_BYTES}")
    outer = _unpack(payload, 3)
    if not isinstance(outer, dict) or set(outer) != {"gen", "list", "signature"}:
        raise _bad("a source list must be a map of gen, list, signature")
    if outer["gen"] != SOURCES_GEN:
        raise _bad(f"source list generation {outer['gen']!r} is not {SOURCES_GEN}")
    signed = _field(outer, "list", bytes)
    signature = _field(outer, "signature", bytes)
    if len(signature) != SIGNATURE_BYTES:
        raise _bad("the signature must be 64 bytes")
    data = _unpack(signed, len(_LIST_KEYS | _PARTIAL_LIST_KEYS) + 1)
    if not isinstance(data, dict) or data.get("gen") != SOURCES_GEN:
        raise _bad(f"the signed list must have exactly the keys {sorted(_LIST_KEYS)}")
    chain = _CHAIN_KEY in data
    if chain and data[_CHAIN_KEY] is not True:
        raise _bad("a source list's chain must be true when present")
    keys = set(data) - {_CHAIN_KEY}
    partial = keys == _LIST_KEYS | _PARTIAL_LIST_KEYS
    if keys != _LIST_KEYS and not partial:
        raise _bad(f"the signed list must have exactly the keys {sorted(_LIST_KEYS)}")
    rank, ranks = (_field(data, "rank", int), _field(data, "ranks", int)) if partial else (0, 1)
    if not 0 <= rank < ranks <= MAX_RANKS:
        raise _bad("a source list's rank must be in 0..ranks-1, ranks in 1..64")
    entry_keys = _ENTRY_KEYS | _PARTIAL_ENTRY_KEYS if partial else _ENTRY_KEYS
    requester = _field(data, "requester_id", bytes)
    chunk_bytes = _field(data, "chunk_bytes", int)
    try:
        check_chunk_bytes(chunk_bytes)
    except UsageError as exc:
        raise _bad(exc.message) from None
    raw_entries = _field(data, "artifacts", list)
    entries = []
    for raw in raw_entries:
        if not isinstance(raw, dict) or set(raw) != entry_keys:
            raise _bad(f"an artifact entry must have exactly the keys {sorted(entry_keys)}")
        size = _field(raw, "size", int)
        holders = _field(raw, "holders", list)
        if size <= 0 or len(holders) > MAX_HOLDERS:
            raise _bad("an artifact entry has a bad size or too many holders")
        if not all(isinstance(h, bytes) and len(h) == 32 for h in holders):
            raise _bad("a holder must be a 32-byte node id")
        blob = _field(raw, "digests", bytes)
        try:
            digests = unpack_digests(blob, chunk_count(size, chunk_bytes))
        except IntegrityError as exc:
            raise _bad(exc.message) from None
        have: tuple[frozenset[int] | None, ...] = ()
        busy: tuple[frozenset[int], ...] = ()
        if partial:
            have = _have_field(raw, "have", len(holders), len(digests))
            raw_busy = _have_field(raw, "busy", len(holders), len(digests))
            busy = tuple(b or frozenset() for b in raw_busy)
        entries.append(
            ArtifactSources(
                _field(raw, "path", str),
                _field(raw, "sha256", str),
                size,
                digests,
                tuple(h.hex() for h in holders),
                have,
                busy,
            )
        )
    if len(requester) != 32:
        raise _bad("requester_id must be 32 bytes")
    sources = SourceList(
        _field(data, "topology_id", str),
        _field(data, "run_id", str),
        _field(data, "manifest_sha256", str),
        _field(data, "stage_id", str),
        requester.hex(),
        chunk_bytes,
        tuple(entries),
        rank=rank,
        ranks=ranks,
        partial=partial,
        chain=chain,
    )
    return sources, signed, signature


def _have_field(
    raw: Mapping[str, Any], key: str, holders: int, chunks: int
) -> tuple[frozenset[int] | None, ...]:
    """An entry's ``have`` or ``busy``: one bitmap (or nil) per holder."""
    have = _field(raw, key, list)
    if len(have) != holders:
        raise _bad(f"an artifact entry's {key} must name one bitmap per holder")
    out: list[frozenset[int] | None] = []
    for blob in have:
        if blob is None:
            out.append(None)
            continue
        if not isinstance(blob, bytes):
            raise _bad("a holder's chunks must be a bitmap")
        try:
            out.append(unpack_bitmap(blob, chunks))
        except ArtifactWireError as exc:
            raise _bad(exc.message) from None
    return tuple(out)


def check_source_list(
    sources: SourceList,
    topology: SplitTopology,
    required: Mapping[str, tuple[str, int]],
    requester_id: str,
    coordinator_id: str,
    *,
    siblings_ok: bool = False,
) -> SourceList:
    """The requester's checks (after the signature): the list is for this topology, run,
    manifest, requester and its stage; it names only artifacts of that stage, with the
    manifest's size and SHA-256; holders are members (the coordinator or a stage node) other
    than the requester. ``required``: the stage's required set from the verified manifest,
    path -> (SHA-256, size) (``required_set``). Raises ``IntegrityError``
    (``source_list_mismatch``). ``siblings_ok`` (both this node and the
    coordinator advertise ``sibling-serve``): holders outside the topology are taken on the
    coordinator's signature, as nodes of its sibling replicas (the requester cannot see
    those topologies; each such holder authorizes the requester against the sibling topology
    it gets from the same coordinator, and every chunk is checked against the signed
    digests)."""

    def bad(why: str) -> IntegrityError:
        return IntegrityError(f"the source list {why}", code="source_list_mismatch")

    stage = topology.stage_of(requester_id)
    if stage is None or sources.requester_id != requester_id or sources.stage_id != stage.stage_id:
        raise bad("is not for this node's stage")
    if (sources.topology_id, sources.run_id, sources.manifest_sha256) != (
        topology.topology_id,
        topology.run_id,
        topology.manifest_sha256,
    ):
        raise bad("names another topology, run or manifest")
    members = {s.node_id for s in topology.stages} | {coordinator_id}
    seen: set[str] = set()
    for entry in sources.artifacts:
        declared = required.get(entry.path)
        if declared is None or entry.path in seen:
            raise bad(f"names {entry.path!r}, which this stage does not need")
        seen.add(entry.path)
        if (entry.sha256, entry.size) != declared:
            raise bad(f"declares {entry.path} unlike the manifest")
        if any(len(d) != DIGEST_BYTES for d in entry.digests):
            raise bad(f"has a malformed digest for {entry.path}")
        if sources.chain:
            if not chain_fits(sources.chunk_bytes):
                raise bad("carries chunk chains this node cannot check")
            try:
                check_chain(entry.digests, entry.sha256, sources.chunk_bytes)
            except IntegrityError:
                raise bad(
                    f"has a chunk chain for {entry.path} that does not end at its SHA-256"
                ) from None
        strangers = set() if siblings_ok else set(entry.holders) - members
        if strangers or requester_id in entry.holders:
            raise bad(f"names a holder of {entry.path} outside the topology")
    return sources
