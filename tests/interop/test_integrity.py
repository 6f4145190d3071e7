"""Damaged files are caught: llmkit checkpoints carry the SHA-256 of every file they write and loading verifies them
(a byte changed inside a tensor is named, not loaded as garbage); weights that are NaN or infinite after loading,
from any source, and logits that are during generation, are clear errors naming the tensor or the step."""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path

import pytest
import torch
from helpers import tiny_tokenizer

from llmkit import build_model, get_preset
from llmkit.cli import main
from llmkit.errors import GenerationError
from llmkit.generate import beam_search, generate, speculative_generate
from llmkit.interop.checkpoint import FORMAT_FILE, load_llmkit, save_llmkit
from llmkit.interop.load import load_model
from llmkit.interop.safetensors_io import CheckpointError

NAN = struct.pack("<f", float("nan")) * 16  # 64 bytes: sixteen fp32 NaNs


def tiny(seed: int = 0, **changes: object) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(dataclasses.replace(get_preset("llama2-7b-tiny"), vocab_size=320, **changes)).eval()


def overwrite_inside(path: Path, tensor: str, data: bytes) -> None:
    """Replace bytes in the middle of `tensor`'s data in a safetensors file, its header untouched."""
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    begin, end = json.loads(raw[8 : 8 + n])[tensor]["data_offsets"]
    at = 8 + n + (begin + end) // 2 // 4 * 4
    raw[at : at + len(data)] = data
    path.write_bytes(bytes(raw))


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    return save_llmkit(tiny(), tmp_path / "ckpt", tokenizer=tiny_tokenizer())


def test_checksums_cover_every_written_file_and_verify(saved):
    meta = json.loads((saved / FORMAT_FILE).read_text())
    files = {p.relative_to(saved).as_posix() for p in saved.rglob("*") if p.is_file() and p.name != FORMAT_FILE}
    assert set(meta["checksums"]) == files and "model.safetensors" in files
    assert all(v.startswith("sha256:") for v in meta["checksums"].values())
    load_model(saved)  # intact: loads


def test_bytes_damaged_inside_a_tensor_are_named(saved, capsys):
    weights = saved / "model.safetensors"
    overwrite_inside(weights, "blocks.0.attn.wq.weight", NAN)
    with pytest.raises(CheckpointError, match=r"model\.safetensors is damaged"):
        load_model(saved)
    # without the checksum check, the NaNs themselves are caught after loading, by tensor name
    with pytest.raises(CheckpointError, match=r"blocks\.0\.attn\.wq\.weight .* holds 16 NaN"):
        load_model(saved, verify=False)
    assert main(["generate", str(saved), "--prompt", "to be", "--max-new-tokens", "3"]) == 2
    assert "model.safetensors is damaged" in capsys.readouterr().err
    assert main(["generate", str(saved), "--prompt", "to be", "--max-new-tokens", "3", "--no-verify"]) == 2
    assert "holds 16 NaN" in capsys.readouterr().err


def test_finite_damage_is_caught_by_the_checksum_alone(saved):
    """Bytes that still read as ordinary numbers: only the checksum can tell; --no-verify loads them as they are."""
    overwrite_inside(saved / "model.safetensors", "blocks.1.ffn.w2.weight", bytes(64))
    with pytest.raises(CheckpointError, match="damaged"):
        load_llmkit(saved)
    assert load_llmkit(saved, verify=False).model is not None


def test_a_listed_file_that_is_gone_and_old_checkpoints_without_checksums(saved):
    (saved / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"tokenizer\.json is missing"):
        load_llmkit(saved)
    meta = json.loads((saved / FORMAT_FILE).read_text())
    del meta["checksums"]
    (saved / FORMAT_FILE).write_text(json.dumps(meta))
    assert load_llmkit(saved).model is not None  # saved before checksums existed: nothing to verify


def test_non_finite_logits_name_the_step_in_every_decoder():
    """Finite weights whose logits overflow (a head scaled to 1e38): generation stops with a GenerationError at the
    first step, in plain, beam and speculative decoding, instead of a traceback from inside sampling."""
    model = tiny()
    with torch.no_grad():
        model.embed.weight.mul_(1e38 / model.embed.weight.abs().max())
    prompts = [[5, 17, 3]]
    with pytest.raises(GenerationError, match=r"logits at decoding step 0 \(rows \[0\]\) are NaN or infinite"):
        generate(model, prompts, max_new_tokens=4, temperature=0.8)
    with pytest.raises(GenerationError, match="NaN or infinite"):
        generate(model, prompts, max_new_tokens=4)  # greedy would print garbage without a word
    with pytest.raises(GenerationError, match="NaN or infinite"):
        beam_search(model, prompts, num_beams=2, max_new_tokens=4)
    with pytest.raises(GenerationError, match="NaN or infinite"):
        speculative_generate(model, prompts, draft=tiny(1), max_new_tokens=4)


def test_a_damaged_trainer_state_stops_a_resume(tmp_path):
    from llmkit.train.checkpoint import ResumeError, TrainState, load, save

    model = tiny()
    state = TrainState(step=3, tokens=96, elapsed=1.0)
    ckpt = save(tmp_path / "run", model, model.state_dict(), {"state": {}, "param_groups": []}, state, 2, None, {})
    assert load(ckpt, model.cfg).state.step == 3
    blob = bytearray((ckpt / "trainer_state.pt").read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    (ckpt / "trainer_state.pt").write_bytes(bytes(blob))
    with pytest.raises(ResumeError, match=r"trainer_state\.pt is damaged"):
        load(ckpt, model.cfg)
