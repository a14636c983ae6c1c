"""Our raw-copy fragment writer against gguf-py's GGUFWriter/GGUFReader."""

from __future__ import annotations

import hashlib

import gguf
import numpy as np
import pytest

from skippy.gguf.constants import ValueType
from skippy.gguf.reader import open_gguf
from skippy.gguf.writer import TensorSource, encode_kv, write_fragment


@pytest.mark.parametrize("kind", ["llama", "gemma", "projector"])
def test_full_copy_is_byte_identical_to_the_source(synth_dir, tmp_path, kind):
    """Copying every KV record and tensor reproduces a gguf-py file exactly: same header
    layout, same padding, same data offsets."""
    src_path = getattr(synth_dir, kind)
    out = tmp_path / "copy.gguf"
    with open_gguf(src_path) as src:
        written = write_fragment(
            out,
            [src.raw_field(k) for k in src.fields],
            [TensorSource(t, src.fileno()) for t in src.tensors],
            src.alignment,
        )
    data = out.read_bytes()
    assert data == src_path.read_bytes()
    assert written.sha256 == hashlib.sha256(data).hexdigest()
    assert written.artifact_bytes == len(data)


def test_subset_fragment_reads_back_in_gguf_py(synth_dir, tmp_path):
    out = tmp_path / "frag.gguf"
    with open_gguf(synth_dir.llama) as src:
        keep = [t for t in src.tensors if t.name.startswith("blk.1.")]
        records = [src.raw_field("general.architecture")]
        records.append(encode_kv("split.no", ValueType.UINT16, 7))
        records.append(encode_kv("x.list", ValueType.ARRAY, ["a", "bc"], ValueType.STRING))
        records.append(encode_kv("x.f", ValueType.FLOAT32, 0.5))
        write_fragment(out, records, [TensorSource(t, src.fileno()) for t in keep], 32)
        expected = {t.name: (t, src.read_range(t.data_start, t.nbytes)) for t in keep}
    r = gguf.GGUFReader(out)
    assert r.fields["general.architecture"].contents() == "llama"
    assert r.fields["split.no"].contents() == 7
    assert r.fields["split.no"].types == [gguf.GGUFValueType.UINT16]
    assert r.fields["x.list"].contents() == ["a", "bc"]
    assert r.fields["x.f"].contents() == pytest.approx(0.5)
    assert [t.name for t in r.tensors] == list(expected)
    for t in r.tensors:
        info, raw = expected[t.name]
        assert int(t.tensor_type) == info.ggml_type
        assert tuple(int(d) for d in t.shape) == info.shape
        assert int(t.n_bytes) == info.nbytes
        assert np.asarray(t.data).tobytes() == raw
        assert t.data_offset % 32 == 0


def test_zero_tensor_fragment_is_padded_and_valid(tmp_path):
    out = tmp_path / "meta.gguf"
    w = write_fragment(out, [encode_kv("general.architecture", ValueType.STRING, "llama")], [], 32)
    assert w.artifact_bytes % 32 == 0 and w.tensor_count == 0 and w.tensor_bytes == 0
    assert len(gguf.GGUFReader(out).tensors) == 0
    with open_gguf(out) as g:
        assert g.value("general.architecture") == "llama"
