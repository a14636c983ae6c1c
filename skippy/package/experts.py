"""Mixture-of-experts accounting and checks, from a model's metadata and tensor directory (pure).

A MoE layer keeps every routed expert in memory but reads only ``expert_used_count`` of its
``expert_count`` experts per token. So a stage's memory is all of its bytes, and its decode
time (bound by reading weights) follows the bytes it touches per token:

    active bytes = dense bytes + routed expert bytes * expert_used_count // expert_count

Routed experts are the tensors ``blk.N.ffn_{gate,up,down}_exps`` and the fused
``ffn_gate_up_exps`` (weights and biases), each holding all experts along its last GGUF
dimension. Everything else counts as dense: attention, norms, the router ``ffn_gate_inp``,
shared experts (``*_shexp``: every token runs them). Parameters are counted the same way over
every tensor of the model (embeddings included). The division is exact whenever each expert
has the same bytes, which one tensor per kind guarantees.

``summarize`` also checks what a MoE model's metadata and tensors must agree on, and raises a
coded ``ModelError`` before anything reaches ggml: expert tensors without ``expert_count``,
``expert_used_count`` outside 1..``expert_count``, an expert tensor whose expert dimension is
not ``expert_count``, a router that is not ``embedding_length`` x ``expert_count``, an expert
FFN length that disagrees with ``expert_feed_forward_length`` (or between gate, up and down).
``check_metadata`` is the part of it that needs the metadata alone.

Vocabulary: ``skippy.constants`` (the names gguf-py's ``Keys.LLM`` and ``TENSOR_NAMES`` use;
kept apart from gguf-py, whose import costs ~0.23 s on ``inspect``'s path).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from skippy.constants import (
    BLOCK_TENSOR_RE,
    EMBEDDING_LENGTH_KEY,
    EXPERT_COUNT_KEY,
    EXPERT_FF_LENGTH_KEY,
    EXPERT_TENSOR_KINDS,
    EXPERT_USED_COUNT_KEY,
    KEY_ARCHITECTURE,
    ROUTER_TENSOR_KIND,
    arch_key,
)
from skippy.errors import ModelError

MAX_EXPERTS: Final = 4096  # the largest released MoE models route over a few hundred
_FUSED: Final = "ffn_gate_up_exps"
_DOWN: Final = "ffn_down_exps"
_HINT: Final = (
    "the file's MoE metadata and its expert tensors disagree: re-convert the model with "
    "llama.cpp's convert_hf_to_gguf.py"
)


class TensorLike(Protocol):
    """What is read of a tensor: the reader's ``TensorInfo`` and ``CatalogTensor`` both fit."""

    @property
    def name(self) -> str: ...

    @property
    def shape(self) -> tuple[int, ...]: ...  # GGUF order, ne0 first

    @property
    def nbytes(self) -> int: ...


@dataclass(frozen=True)
class ExpertConfig:
    """The MoE keys of a model's metadata; ``expert_count`` 0 is a dense model."""

    arch: str | None
    expert_count: int = 0
    used_count: int = 0
    ff_length: int | None = None  # expert_feed_forward_length, when the file says it
    width: int | None = None  # embedding_length, when the file says it

    @property
    def moe(self) -> bool:
        return self.expert_count > 0


@dataclass(frozen=True)
class LayerExperts:
    """One layer's tensors: all of them, and the routed experts among them."""

    layer: int
    total_bytes: int
    expert_bytes: int
    total_params: int
    expert_params: int


@dataclass(frozen=True)
class ExpertSummary:
    config: ExpertConfig
    layers: tuple[LayerExperts, ...]  # the layers whose tensors were seen, by index
    total_params: int  # every tensor, embeddings and head included
    expert_params: int  # the routed experts' share of it
    total_bytes: int
    expert_bytes: int
    _by_layer: dict[int, LayerExperts] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_layer", {e.layer: e for e in self.layers})

    @property
    def moe(self) -> bool:
        return self.config.moe

    def active(self, routed: int) -> int:
        """The share of ``routed`` (expert bytes or parameters) one token reads."""
        c = self.config
        return routed * c.used_count // c.expert_count if c.moe else routed

    @property
    def active_params(self) -> int:
        return self.total_params - self.expert_params + self.active(self.expert_params)

    @property
    def active_bytes(self) -> int:
        return self.total_bytes - self.expert_bytes + self.active(self.expert_bytes)

    def inactive_bytes(self, layer: int) -> int:
        """Bytes of ``layer`` a token does not read (its unrouted experts); 0 for a layer
        never seen or a dense one."""
        e = self._by_layer.get(layer)
        return 0 if e is None else e.expert_bytes - self.active(e.expert_bytes)

    def to_dict(self) -> dict[str, Any]:
        c = self.config
        return {
            "moe": self.moe,
            "expert_count": c.expert_count,
            "expert_used_count": c.used_count,
            "expert_feed_forward_length": c.ff_length,
            "moe_layers": sum(1 for e in self.layers if e.expert_bytes),
            "total_params": self.total_params,
            "active_params": self.active_params,
            "total_bytes": self.total_bytes,
            "expert_bytes": self.expert_bytes,
            "active_bytes": self.active_bytes,
        }


def metadata_keys(arch: str) -> tuple[str, ...]:
    """The keys ``check_metadata`` reads for ``arch`` (besides the architecture)."""
    names = (EXPERT_COUNT_KEY, EXPERT_USED_COUNT_KEY, EXPERT_FF_LENGTH_KEY, EMBEDDING_LENGTH_KEY)
    return tuple(arch_key(arch, n) for n in names)


def metadata_from(get: Callable[[str], Any]) -> dict[str, Any]:
    """The few keys this module reads, through a reader's ``get`` (no whole-KV decode)."""
    arch = get(KEY_ARCHITECTURE)
    out: dict[str, Any] = {KEY_ARCHITECTURE: arch}
    if isinstance(arch, str):
        out.update({k: get(k) for k in metadata_keys(arch)})
    return out


def _error(message: str, code: str, **kw: Any) -> ModelError:
    return ModelError(message, code=code, remediation=_HINT, **kw)


def _int_key(kv: Mapping[str, Any], key: str, code: str, hi: int) -> int | None:
    v = kv.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= hi:
        raise _error(f"{key} = {str(v)[:40]} is not an integer in 0..{hi}", code, actual=key)
    return v


def check_metadata(kv: Mapping[str, Any]) -> ExpertConfig:
    """The MoE keys of ``kv``, checked on their own (no tensors needed)."""
    arch = kv.get(KEY_ARCHITECTURE)
    if not isinstance(arch, str) or not arch:
        return ExpertConfig(None)
    key = {n: arch_key(arch, n) for n in (EXPERT_COUNT_KEY, EXPERT_USED_COUNT_KEY)}
    count = _int_key(kv, key[EXPERT_COUNT_KEY], "moe_expert_count_invalid", MAX_EXPERTS) or 0
    used = _int_key(kv, key[EXPERT_USED_COUNT_KEY], "moe_expert_used_count_invalid", MAX_EXPERTS)
    ff = _int_key(kv, arch_key(arch, EXPERT_FF_LENGTH_KEY), "moe_expert_ff_mismatch", 1 << 24)
    width = kv.get(arch_key(arch, EMBEDDING_LENGTH_KEY))
    width = width if isinstance(width, int) and not isinstance(width, bool) else None
    if count == 0:
        if used:
            raise _error(
                f"{key[EXPERT_USED_COUNT_KEY]} = {used} but {key[EXPERT_COUNT_KEY]} is missing "
                "or 0: a model that routes to experts must say how many it has",
                "moe_expert_count_missing",
                actual=key[EXPERT_COUNT_KEY],
            )
        return ExpertConfig(arch, ff_length=ff, width=width)
    if used is None or not 1 <= used <= count:
        what = "missing" if used is None else str(used)
        raise _error(
            f"{key[EXPERT_USED_COUNT_KEY]} is {what}; a model of {count} experts routes each "
            f"token to 1..{count} of them",
            "moe_expert_used_count_invalid",
            expected=[1, count],
            actual=used,
        )
    return ExpertConfig(arch, count, used, ff, width)


def _kind(name: str) -> tuple[int | None, str, str]:
    """(layer, kind, suffix) of ``blk.N.KIND.SUFFIX``; (None, name, "") for other tensors."""
    m = BLOCK_TENSOR_RE.match(name)
    if m is None:
        return None, name, ""
    kind, _, suffix = name[m.end() :].rpartition(".")
    return int(m.group(1)), kind, suffix


def _elements(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _check_expert_tensor(t: TensorLike, kind: str, suffix: str, c: ExpertConfig) -> None:
    rank = 3 if suffix == "weight" else 2  # a weight: (in, out, experts); a bias: (out, experts)
    if len(t.shape) != rank or t.shape[-1] != c.expert_count:
        raise _error(
            f"{t.name} has shape {list(t.shape)}; with {c.expert_count} experts it must be "
            f"rank {rank} with {c.expert_count} as its last (expert) dimension",
            "moe_expert_shape_mismatch",
            expected=c.expert_count,
            actual=list(t.shape),
        )
    if rank == 3 and c.width is not None:
        width_dim = 1 if kind == _DOWN else 0  # down maps the expert FFN back to the width
        if t.shape[width_dim] != c.width:
            raise _error(
                f"{t.name} has shape {list(t.shape)}; its model width is {c.width}",
                "moe_expert_shape_mismatch",
                expected=c.width,
                actual=list(t.shape),
            )


def _ff_of(t: TensorLike, kind: str) -> int:
    """The expert FFN length a weight implies (fused gate+up holds two of them)."""
    if kind == _DOWN:
        return t.shape[0]
    return t.shape[1] // 2 if kind == _FUSED else t.shape[1]


def _check_layer(layer: int, experts: list[tuple[TensorLike, str]], c: ExpertConfig) -> None:
    lengths = {(t.name, _ff_of(t, kind)) for t, kind in experts}
    want = c.ff_length
    for name, ff in sorted(lengths):
        if want is None:
            want = ff  # no key: gate, up and down must still agree with each other
        if ff != want:
            source = (
                arch_key(c.arch or "?", EXPERT_FF_LENGTH_KEY)
                if c.ff_length is not None
                else "the layer's other expert tensors"
            )
            raise _error(
                f"{name} implies an expert FFN length of {ff}; {source} say(s) {want} "
                f"(layer {layer})",
                "moe_expert_ff_mismatch",
                expected=want,
                actual=ff,
            )


def _check_router(t: TensorLike, c: ExpertConfig) -> None:
    if c.expert_count == 0:
        raise _error(
            f"{t.name} routes tokens to experts, but the metadata's expert_count is missing "
            "or 0",
            "moe_expert_count_missing",
            actual=t.name,
        )
    width_ok = c.width is None or (len(t.shape) >= 1 and t.shape[0] == c.width)
    if len(t.shape) != 2 or t.shape[1] != c.expert_count or not width_ok:
        raise _error(
            f"router {t.name} has shape {list(t.shape)}; it must be [{c.width or 'width'}, "
            f"{c.expert_count}] (one logit per expert from each {c.width or 'width'}-wide "
            "activation)",
            "moe_router_shape_mismatch",
            expected=[c.width, c.expert_count],
            actual=list(t.shape),
        )


def summarize(
    kv: Mapping[str, Any], tensors: Iterable[TensorLike], *, whole_model: bool = True
) -> ExpertSummary:
    """Check ``tensors`` against ``kv``'s MoE keys and count each layer's bytes and
    parameters. ``whole_model``: the tensors are the whole model's (a source GGUF, a package),
    so MoE metadata with no expert tensor at all is an error too; a stage's parts hold only
    its own layers."""
    c = check_metadata(kv)
    per_layer: dict[int, list[int]] = {}  # layer -> [bytes, expert bytes, params, expert params]
    experts: dict[int, list[tuple[TensorLike, str]]] = {}
    routers: dict[int, TensorLike] = {}
    total_params = expert_params = total_bytes = expert_bytes = 0
    any_layer = False
    for t in tensors:
        layer, kind, suffix = _kind(t.name)
        n = _elements(t.shape)
        total_params += n
        total_bytes += t.nbytes
        if layer is None:
            continue
        any_layer = True
        row = per_layer.setdefault(layer, [0, 0, 0, 0])
        row[0] += t.nbytes
        row[2] += n
        if kind == ROUTER_TENSOR_KIND and suffix == "weight":
            routers[layer] = t
        if kind not in EXPERT_TENSOR_KINDS:
            continue
        if not c.moe:
            raise _error(
                f"{t.name} holds routed experts, but the metadata's "
                f"{arch_key(c.arch or '?', EXPERT_COUNT_KEY)} is missing or 0",
                "moe_expert_count_missing",
                actual=t.name,
            )
        _check_expert_tensor(t, kind, suffix, c)
        if suffix == "weight":
            experts.setdefault(layer, []).append((t, kind))
        row[1] += t.nbytes
        row[3] += n
        expert_params += n
        expert_bytes += t.nbytes
    for t in routers.values():
        _check_router(t, c)
    for layer in sorted(set(routers) ^ set(experts)):
        has = "a router but no expert weights" if layer in routers else "experts but no router"
        raise _error(
            f"layer {layer} has {has}: a MoE layer needs both "
            f"(blk.{layer}.{ROUTER_TENSOR_KIND}.weight and the ffn_*_exps weights)",
            "moe_layer_incomplete",
            actual=layer,
        )
    for layer, found in sorted(experts.items()):
        _check_layer(layer, found, c)
    if whole_model and c.moe and any_layer and not experts:
        raise _error(
            f"{arch_key(c.arch or '?', EXPERT_COUNT_KEY)} = {c.expert_count}, but no layer "
            "holds expert tensors (ffn_*_exps)",
            "moe_experts_missing",
            expected=c.expert_count,
        )
    layers = tuple(
        LayerExperts(i, r[0], r[1], r[2], r[3]) for i, r in sorted(per_layer.items())
    )
    return ExpertSummary(c, layers, total_params, expert_params, total_bytes, expert_bytes)


def routed_layer_bytes(layer_count: int, summary: ExpertSummary) -> tuple[int, ...]:
    """Each layer's routed-expert bytes (0 for a dense layer or one never seen)."""
    by_layer = {e.layer: e.expert_bytes for e in summary.layers}
    return tuple(by_layer.get(i, 0) for i in range(layer_count))


def active_layer_bytes(layer_bytes: Iterable[int], summary: ExpertSummary) -> tuple[int, ...]:
    """Each layer's bytes (a fragment's, headers included) less what a token does not read."""
    return tuple(b - summary.inactive_bytes(i) for i, b in enumerate(layer_bytes))


__all__ = [
    "MAX_EXPERTS",
    "ExpertConfig",
    "ExpertSummary",
    "LayerExperts",
    "TensorLike",
    "active_layer_bytes",
    "check_metadata",
    "metadata_from",
    "metadata_keys",
    "routed_layer_bytes",
    "summarize",
]
