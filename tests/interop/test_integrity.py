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


def test_a_weights_file_that_links_to_itself_is_a_one_line_error(saved, capsys):
    """A link that leads back to itself was a traceback (RuntimeError: Symlink loop, from Path.resolve)."""
    weights = saved / "model.safetensors"
    weights.unlink()
    weights.symlink_to(weights.name)
    with pytest.raises(CheckpointError, match=r"model\.safetensors cannot be read: Too many levels of symbolic links"):
        load_llmkit(saved)
    for extra in ([], ["--no-verify"]):
        assert main(["generate", str(saved), "--prompt", "to be", "--max-new-tokens", "3", *extra]) == 2
        err = capsys.readouterr().err
        assert "model.safetensors" in err and "Traceback" not in err and len(err.splitlines()) == 1, err


def test_a_listed_file_that_is_gone(saved):
    (saved / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"tokenizer\.json is missing"):
        load_llmkit(saved)


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([[5, 17, 3, 99, 42, 7]]))


@pytest.mark.parametrize(
    ("before", "after"),
    [('"eps": 1e-05', '"eps": 0.1'), ('"theta": 10000.0', '"theta": 90000.0')],
    ids=["norm-eps", "rope-theta"],
)
def test_a_one_byte_config_edit_is_refused(saved, before, after):
    """The config decides what the weights compute: an edited eps or RoPE theta loads without a word unless the
    manifest covers llmkit.json's own fields (it changes the logits, so loading it silently would be wrong)."""
    meta_file = saved / FORMAT_FILE
    text = meta_file.read_text()
    assert text.count(before) == 1
    meta_file.write_text(text.replace(before, after))
    with pytest.raises(CheckpointError, match=r"llmkit\.json was changed after the checkpoint was saved"):
        load_model(saved)
    edited = load_model(saved, verify=False).model  # the edit matters: the same weights compute other logits
    assert not torch.allclose(logits(edited), logits(tiny()))


@pytest.mark.parametrize(
    ("field", "value"),
    [("generation_config", {"eos_token_id": 7}), ("hf", {"model_type": "llama", "config": {}}), ("checksums", {})],
)
def test_every_field_of_llmkit_json_is_covered(saved, field, value):
    meta = json.loads((saved / FORMAT_FILE).read_text())
    assert meta[field] != value
    meta[field] = value
    (saved / FORMAT_FILE).write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="was changed after the checkpoint was saved"):
        load_model(saved)


def test_a_checkpoint_without_a_manifest_loads_only_unverified_and_says_so(saved, capsys):
    """Removing the manifest (with the checksums, or alone) must not turn verification off silently: such a
    checkpoint loads only with --no-verify / verify=False, with a note; the error says what to do."""
    overwrite_inside(saved / "model.safetensors", "blocks.1.ffn.w2.weight", bytes(64))  # damage that still loads
    meta = json.loads((saved / FORMAT_FILE).read_text())
    del meta["manifest"], meta["checksums"]
    (saved / FORMAT_FILE).write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"has no manifest .* load it with --no-verify") as info:
        load_model(saved)
    assert "llmkit convert" in str(info.value)
    loaded = load_model(saved, verify=False)
    assert any("has no manifest" in note for note in loaded.notes)
    assert main(["generate", str(saved), "--prompt", "to be", "--max-new-tokens", "2"]) == 2
    assert "has no manifest" in capsys.readouterr().err
    assert main(["generate", str(saved), "--prompt", "to be", "--max-new-tokens", "2", "--no-verify"]) == 0
    assert "loaded unverified" in capsys.readouterr().err
    # a verified copy of one the user trusts
    assert main(["convert", str(saved), str(saved.parent / "copy"), "--to", "llmkit", "--no-verify"]) == 0
    assert load_model(saved.parent / "copy").notes == []


def test_a_weight_file_added_after_the_save_is_refused(saved):
    """Loading prefers an index over model.safetensors: an index put there later would change the weights read."""
    (saved / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    with pytest.raises(CheckpointError, match=r"index\.json is not in the checkpoint's manifest"):
        load_model(saved)


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


def test_a_truncated_trainer_state_json_stops_a_resume(tmp_path):
    """trainer_state.json holds the checksum of the optimizer state: one that cannot be read must not skip the
    check (a damaged moment would surface steps later as a diverging loss)."""
    from llmkit.train.checkpoint import ResumeError, TrainState, load, save

    model = tiny()
    state = TrainState(step=3, tokens=96, elapsed=1.0)
    ckpt = save(tmp_path / "run", model, model.state_dict(), {"state": {}, "param_groups": []}, state, 2, None, {})
    readable = ckpt / "trainer_state.json"
    readable.write_bytes(readable.read_bytes()[:40])
    with pytest.raises(ResumeError, match=r"trainer_state\.json cannot be read"):
        load(ckpt, model.cfg)
    readable.unlink()
    with pytest.raises(ResumeError, match=r"trainer_state\.json is missing"):
        load(ckpt, model.cfg)
