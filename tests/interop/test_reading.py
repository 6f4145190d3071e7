"""safetensors_io.read_part: a tensor's part read with pread, in pieces read by several threads at once."""

from __future__ import annotations

import pytest
import torch

from llmkit.interop import safetensors_io
from llmkit.interop.safetensors_io import CheckpointError, read_part


@pytest.fixture
def small_pieces(monkeypatch):
    monkeypatch.setattr(safetensors_io, "PIECE", 1000)  # bytes: many pieces, not aligned to rows or pages


@pytest.mark.parametrize("index", [((0, 37), (0, 300)), ((5, 30), (0, 300)), ((3, 9), (17, 250)), ((36, 37), (0, 1))])
def test_a_part_read_in_pieces_by_threads_is_the_tensor_s_part(tmp_path, small_pieces, index):
    whole = torch.arange(37 * 300, dtype=torch.int32).reshape(37, 300)
    path = tmp_path / "t.bin"
    path.write_bytes(b"x" * 13 + whole.numpy().tobytes())  # the data starts at byte 13
    got = read_part(path, 13, torch.int32, (37, 300), index)
    (a, b), (c, d) = index
    assert torch.equal(got, whole[a:b, c:d])


def test_a_file_shorter_than_its_tensor_is_a_clear_error(tmp_path, small_pieces):
    path = tmp_path / "t.bin"
    path.write_bytes(bytes(5000))
    with pytest.raises(CheckpointError, match="ended while reading a tensor"):
        read_part(path, 0, torch.uint8, (3, 2000), ((0, 3), (0, 2000)))
