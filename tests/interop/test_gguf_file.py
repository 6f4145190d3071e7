"""llmkit's GGUF header reader (interop/gguf_file.py) against the `gguf` package's, and on damaged files: a file cut by
one byte, or a tensor whose extent runs past the end, is a one-line CheckpointError before anything is mapped. And
a memory-mapped load: K-quant tensors are views of the file's map, so loading a model costs the process less memory
than its weights."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf_files import write_gguf

from llmkit.interop.gguf_file import GGUFFile
from llmkit.interop.safetensors_io import CheckpointError

gguf = pytest.importorskip("gguf")
KINDS = {"attn_q": "Q4_K", "attn_v": "Q6_K", "ffn_gate": "Q4_K", "ffn_up": "Q8_0", "ffn_down": "Q6_K"}


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("gguf") / "model.gguf"
    write_gguf(p, KINDS)
    return p


def test_the_reader_sees_what_the_gguf_package_sees(path):
    ours, theirs = GGUFFile(path), gguf.GGUFReader(str(path))
    theirs_fields = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}  # (its header)
    assert ours.fields == theirs_fields
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert a.tensor_type == b.tensor_type and list(a.shape) == list(b.shape)
        assert a.data_offset == b.data_offset and a.n_bytes == b.n_bytes
        assert a.data.shape == b.data.shape and np.array_equal(a.data, b.data), a.name


def _one_line(e: pytest.ExceptionInfo[CheckpointError]) -> str:
    message = str(e.value)
    assert "\n" not in message
    return message


def test_a_file_cut_by_one_byte_is_a_one_line_error(path, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(CheckpointError) as e:
        GGUFFile(cut)
    assert "is truncated or damaged: tensor" in _one_line(e) and "past the file's" in _one_line(e)


def test_a_tensor_extent_past_the_end_is_a_one_line_error(path, tmp_path):
    data = bytearray(path.read_bytes())
    last = GGUFFile(path).tensors[-1]
    # the last tensor record's offset (the header's last 8 bytes before the padding), moved past the end
    name = last.name.encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    offset_at = at + 4 + 8 * n_dims + 4
    struct.pack_into("<Q", data, offset_at, len(data))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as e:
        GGUFFile(bad)
    assert f"tensor {last.name} ends at byte" in _one_line(e)


def test_a_header_cut_short_is_a_one_line_error(path, tmp_path):
    cut = tmp_path / "header.gguf"
    cut.write_bytes(path.read_bytes()[:200])
    with pytest.raises(CheckpointError) as e:
        GGUFFile(cut)
    assert "runs past the end" in _one_line(e)


CHILD = """
import json, sys
from llmkit.interop.load import load_model
def rss():
    return int(open('/proc/self/status').read().split('VmRSS:')[1].split()[0]) * 1024
load_model(sys.argv[1])  # once: every lazy import and allocator pool in place
before = rss()
loaded = load_model(sys.argv[1])
after = rss()
from llmkit.quant import weight_bytes
print(json.dumps({"growth": after - before, "weights": weight_bytes(loaded.model)}))
"""


MIXES = {
    "K-quants": {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K", "ffn_gate": "Q4_K",
                 "ffn_up": "Q5_K", "ffn_down": "Q6_K", "token_embd": "Q6_K"},
    "32-weight types": {"attn_q": "Q8_0", "attn_k": "Q4_0", "attn_v": "Q5_0", "attn_output": "Q4_1",
                        "ffn_gate": "Q4_0", "ffn_up": "Q5_1", "ffn_down": "IQ4_NL", "token_embd": "Q8_0"},
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("mix", list(MIXES))
def test_a_memory_mapped_load_grows_resident_memory_by_less_than_the_weights(tmp_path, mix):
    """Every block type is a view of the map, read as the kernels use it: loading a file a second time in a child
    process grows its resident memory by less than half the weights' bytes (the F32 norms are copied, and the
    llama architecture's q and k rows, which are reordered; the other blocks are not read)."""
    p = tmp_path / "k.gguf"
    write_gguf(p, MIXES[mix], untied=True, width=1024, layers=6)
    out = subprocess.run([sys.executable, "-c", CHILD, str(p)], capture_output=True, text=True, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["weights"] > 20e6
    assert r["growth"] < 0.5 * r["weights"], r
