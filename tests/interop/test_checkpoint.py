import json

import pytest
import torch

from llmkit import build_model, get_preset
from llmkit.interop.checkpoint import load_llmkit, save_llmkit
from llmkit.interop.keymap import MappingError
from llmkit.interop.load import detect_format, load_model
from llmkit.interop.safetensors_io import CheckpointError


@pytest.mark.parametrize("name", ["deepseek-v3.2-tiny", "transformer-base-tiny", "mixtral-8x7b-tiny"])
def test_llmkit_format_round_trips(tmp_path, name):
    model = build_model(get_preset(name)).eval()
    save_llmkit(model, tmp_path / "ck")
    assert detect_format(tmp_path / "ck") == "llmkit"
    loaded = load_model(tmp_path / "ck")
    assert loaded.source == "llmkit" and loaded.model.cfg == model.cfg
    for (k, a), (_, b) in zip(loaded.model.state_dict().items(), model.state_dict().items(), strict=True):
        assert torch.equal(a, b), k


def test_bf16_save_keeps_router_bias_exact(tmp_path):
    model = build_model(get_preset("deepseek-v3-tiny"))
    model.blocks[1].ffn.router.score_bias.fill_(0.123456789)
    save_llmkit(model, tmp_path / "ck", dtype=torch.bfloat16)
    back = load_llmkit(tmp_path / "ck").model
    assert next(back.parameters()).dtype == torch.bfloat16
    assert back.blocks[1].ffn.router.score_bias.dtype == torch.float32
    assert back.blocks[1].ffn.router.score_bias[0].item() == pytest.approx(0.123456789)


def test_errors(tmp_path):
    model = build_model(get_preset("gpt2-tiny"))
    save_llmkit(model, tmp_path / "ck")
    meta = json.loads((tmp_path / "ck" / "llmkit.json").read_text())
    meta["config"]["d_model"] = 32
    (tmp_path / "ck" / "llmkit.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"llmkit\.json was changed after the checkpoint was saved"):
        load_llmkit(tmp_path / "ck")  # the manifest catches the edit; unverified, the config is checked itself
    with pytest.raises(MappingError, match=r"shape mismatch: .* but the config implies"):
        load_llmkit(tmp_path / "ck", verify=False)
    meta["config"]["attention"]["n_heads"] = 5
    (tmp_path / "ck" / "llmkit.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"invalid config: .*n_heads=5"):
        load_llmkit(tmp_path / "ck", verify=False)
    with pytest.raises(CheckpointError, match=r"does not exist"):
        detect_format(tmp_path / "none")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"is not a checkpoint"):
        detect_format(tmp_path / "empty")
