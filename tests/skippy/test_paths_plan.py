"""The path gate, the layer range type and the split planner."""

from __future__ import annotations

import itertools
import os

import pytest

from skippy.errors import UnsafePath, UsageError
from skippy.package.plan import (
    ModelSizes,
    byte_balanced_ranges,
    even_ranges,
    plan_stages,
    tail_layers,
)
from skippy.package.ranges import LayerRange, parse_layer_range
from skippy.paths import check_relative_path, resolve_under


@pytest.mark.parametrize("ok", ["a", "layers/layer-00001.gguf", "shared/metadata.gguf", "a.b/c"])
def test_safe_paths(ok):
    assert check_relative_path(ok) == ok


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "/abs",
        "../x",
        "a/../b",
        "a/./b",
        "./a",
        "a//b",
        "a/",
        "a\\b",
        "C:/x",
        "c:x",
        "a\x00b",
        "..",
        ".",
    ],
)
def test_unsafe_paths(bad):
    with pytest.raises(UnsafePath) as exc:
        check_relative_path(bad)
    assert exc.value.code == "unsafe_artifact_path"


def test_resolve_under_rejects_symlink_escape(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "secret").write_text("x")
    os.symlink(tmp_path / "secret", root / "link")
    with pytest.raises(UnsafePath):
        resolve_under(root, "link")
    (root / "inner").write_text("y")
    os.symlink(root / "inner", root / "ok")
    assert resolve_under(root, "ok") == root / "ok"


def test_resolve_under_with_containment_root(tmp_path):
    repo = tmp_path / "models--a--b"
    (repo / "blobs").mkdir(parents=True)
    (repo / "snapshots" / "c").mkdir(parents=True)
    (repo / "blobs" / "e").write_text("z")
    os.symlink("../../blobs/e", repo / "snapshots" / "c" / "f")
    snap = repo / "snapshots" / "c"
    with pytest.raises(UnsafePath):
        resolve_under(snap, "f")
    assert resolve_under(snap, "f", containment_root=repo).read_text() == "z"


@pytest.mark.parametrize(
    ("text", "n", "expected"),
    [("0..6", 18, (0, 6)), (" 3 .. 4 ", 4, (3, 4)), ("0..1", 1, (0, 1))],
)
def test_parse_layer_range(text, n, expected):
    r = parse_layer_range(text, n)
    assert (r.start, r.stop) == expected
    assert str(parse_layer_range(str(r), n)) == str(r)


@pytest.mark.parametrize(
    ("text", "n"), [("3..3", 4), ("0..5", 4), ("2..1", 4), ("0-3", 4), ("", 4)]
)
def test_bad_layer_ranges(text, n):
    with pytest.raises(UsageError) as exc:
        parse_layer_range(text, n)
    assert exc.value.code == "invalid_layer_range"


def test_layer_range_flags():
    r = LayerRange(0, 4, 4)
    assert r.owns_input and r.owns_output and r.is_full and list(r) == [0, 1, 2, 3]
    mid = LayerRange(1, 3, 4)
    assert not mid.owns_input and not mid.owns_output and 2 in mid and 3 not in mid


@pytest.mark.parametrize(
    ("layers", "stages", "expected"),
    [(18, 3, [6, 6, 6]), (10, 3, [4, 3, 3]), (5, 5, [1] * 5), (7, 2, [4, 3]), (4, 1, [4])],
)
def test_even_ranges_give_first_stages_the_extra_layers(layers, stages, expected):
    ranges = even_ranges(layers, stages)
    assert [len(r) for r in ranges] == expected
    assert ranges[0].start == 0 and ranges[-1].stop == layers
    assert all(a.stop == b.start for a, b in itertools.pairwise(ranges))


def test_too_many_stages():
    with pytest.raises(UsageError) as exc:
        even_ranges(4, 5)
    assert exc.value.code == "stage_count_exceeds_layer_count"


def _brute_force_best(sizes: ModelSizes, stages: int) -> int:
    import itertools

    n = sizes.layer_count
    best = None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = [0, *cuts, n]
        worst = max(sizes.stage_bytes(LayerRange(a, b, n)) for a, b in itertools.pairwise(bounds))
        best = worst if best is None else min(best, worst)
    assert best is not None
    return best


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_byte_balance_is_optimal(tied, stages):
    sizes = ModelSizes(
        layer_bytes=(5, 9, 2, 7, 7, 1, 8, 3),
        metadata_bytes=2,
        embeddings_bytes=11,
        output_bytes=6,
        tied_embeddings=tied,
    )
    ranges = byte_balanced_ranges(sizes, stages)
    assert max(sizes.stage_bytes(r) for r in ranges) == _brute_force_best(sizes, stages)
    plan = plan_stages(sizes, stages, "bytes")
    assert sum(len(s.layers) for s in plan) == 8


def test_even_ranges_keep_the_nextn_tail_with_the_final_stage():
    # 5 trunk layers and 1 NextN layer: the trunk is split, the last stage takes the tail
    ranges = even_ranges(6, 3, tail=1)
    assert [(r.start, r.stop) for r in ranges] == [(0, 2), (2, 4), (4, 6)]
    assert [(r.start, r.stop) for r in even_ranges(6, 5, tail=1)][-1] == (4, 6)
    with pytest.raises(UsageError) as exc:
        even_ranges(6, 6, tail=1)  # a stage of the NextN layer alone
    assert exc.value.code == "stage_count_exceeds_layer_count"


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_byte_balance_never_cuts_between_the_trunk_and_its_tail(stages):
    # the tail layer is tiny: without the rule the cheapest split would give it a stage
    layer_bytes = (5, 9, 2, 7, 7, 30, 1)
    sizes = ModelSizes(layer_bytes, 2, 11, 6, tail_layers=1)
    ranges = byte_balanced_ranges(sizes, stages)
    assert ranges[-1].stop == 7 and ranges[-1].start <= 5
    best = None
    for cuts in itertools.combinations(range(1, 6), stages - 1):
        bounds = [0, *cuts, 7]
        worst = max(sizes.stage_bytes(LayerRange(a, b, 7)) for a, b in itertools.pairwise(bounds))
        best = worst if best is None else min(best, worst)
    assert max(sizes.stage_bytes(r) for r in ranges) == best
    free = byte_balanced_ranges(ModelSizes(layer_bytes, 2, 11, 6), 4)
    assert free[-1].start == 6  # what the tail rule prevents


def test_the_tail_is_read_from_the_native_mtp_layers_of_the_generation_object():
    def gen(indices, kind="native-mtp"):
        proposer = {"type": kind, "prediction_depth": 1, "layer_indices": indices}
        return {"speculative_decoding": {"proposers": {"mtp": proposer}}}

    assert tail_layers(93, gen([92])) == 1
    assert tail_layers(93, gen([91])) == 0  # not the last layer: nothing to keep together
    assert tail_layers(93, gen([92], kind="ngram")) == 0
    assert tail_layers(93, None) == tail_layers(93, {}) == 0


def test_cost_and_memory_placement_keep_the_nextn_tail_with_the_final_stage():
    from skippy.package.cost_plan import LinkCosts, NodeCost, evaluate, plan_by_cost
    from skippy.package.placement import NodeMemory, place

    def cuts(tail: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        sizes = ModelSizes((10,) * 6, 1, 5, 5, tail_layers=tail)
        # the last node is the slowest: speed-weighted counts give it one layer
        speeds = (("a", 0.001), ("b", 0.001), ("c", 1.0))
        nodes = [NodeCost(c * 64, 1 << 40, s) for c, s in speeds]
        by_cost = [(r.start, r.stop) for r in evaluate(sizes, nodes, LinkCosts()).layers]
        if tail:
            assert all(c.layers[-1].start < 5 for c in plan_by_cost(sizes, nodes, LinkCosts()))
        # the first node holds layers 0..5 (56 bytes) but not the whole model (71); with the
        # tail the final stage also holds the embeddings (its NextN head's): 4..6 is 31 bytes
        small = [NodeMemory("a", host_bytes=56), NodeMemory("b", host_bytes=31)]
        by_memory = [(s.layers.start, s.layers.stop) for s in place(sizes, small).stages]
        return by_cost, by_memory

    assert cuts(0) == ([(0, 3), (3, 5), (5, 6)], [(0, 5), (5, 6)])  # what the tail prevents
    assert cuts(1) == ([(0, 2), (2, 4), (4, 6)], [(0, 4), (4, 6)])


def test_stage_bytes_counts_boundaries():
    sizes = ModelSizes((10, 20, 30), 1, 100, 1000, tied_embeddings=True)
    first, last = LayerRange(0, 1, 3), LayerRange(2, 3, 3)
    assert sizes.stage_bytes(first) == 1 + 10 + 100
    assert sizes.stage_bytes(last) == 1 + 30 + 100 + 1000  # tied: embeddings on the last stage
    assert sizes.stage_bytes(LayerRange(1, 2, 3)) == 1 + 20
    # a NextN tail: the final stage's draft head embeds tokens, so it holds the embeddings too
    nextn = ModelSizes((10, 20, 30), 1, 100, 1000, tail_layers=1)
    assert nextn.stage_bytes(LayerRange(1, 3, 3)) == 1 + 20 + 30 + 100 + 1000
    untied = ModelSizes((10, 20, 30), 1, 100, 1000)
    assert untied.stage_bytes(LayerRange(1, 3, 3)) == 1 + 20 + 30 + 1000


def test_plan_refuses_an_absurd_block_count(tmp_path):
    """One flipped byte in block_count must not make `plan` allocate billions of slots."""
    import gguf
    import numpy as np

    from skippy.errors import ModelError
    from skippy.produce.sizes import sizes_from_source

    w = gguf.GGUFWriter(tmp_path / "m.gguf", "llama")
    w.add_block_count(3_000_000_000)
    w.add_tensor("blk.0.attn_norm.weight", np.ones(32, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelError) as exc:
        sizes_from_source(tmp_path / "m.gguf")
    assert exc.value.code == "invalid_block_count"
