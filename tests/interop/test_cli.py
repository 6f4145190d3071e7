import json
import shutil

import pytest
import torch
from helpers import tiny_tokenizer

from llmkit.cli import main
from llmkit.interop.load import load_model

from .hf_models import build_hf, reference


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return build_hf("qwen2", tmp_path_factory.mktemp("cli"))


@pytest.fixture(scope="module")
def qwen2_with_tokenizer(tmp_path_factory, qwen2):
    d = tmp_path_factory.mktemp("cli-tok") / "qwen2"
    shutil.copytree(qwen2, d)
    tiny_tokenizer().save(d)  # files to carry along (its vocabulary is larger than the tiny model's)
    return d


def test_convert_hf_to_llmkit_and_back(qwen2_with_tokenizer, tmp_path, capsys):
    qwen2 = qwen2_with_tokenizer
    assert main(["convert", str(qwen2), str(tmp_path / "mine")]) == 0
    assert "hf " in capsys.readouterr().out
    mine = load_model(tmp_path / "mine")
    assert mine.source == "llmkit" and mine.hf_model_type == "qwen2" and mine.tokenizer is not None
    assert main(["convert", str(tmp_path / "mine"), str(tmp_path / "back"), "--dtype", "bf16"]) == 0
    back_cfg = json.loads((tmp_path / "back" / "config.json").read_text())
    assert back_cfg["model_type"] == "qwen2" and back_cfg["torch_dtype"] == "bfloat16"
    assert (tmp_path / "back" / "tokenizer.json").is_file()
    tokens = torch.randint(0, 96, (1, 9))
    with torch.no_grad():
        a = reference(qwen2)(tokens).logits
        b = reference(tmp_path / "back")(tokens).logits.float()
    torch.testing.assert_close(b, a, rtol=0.05, atol=0.05)  # bf16 weights


def test_compare_json(qwen2, capsys):
    assert main(["compare", str(qwen2), "--json", "--prompt", "to be or not"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["top1_agreement"] == 1.0 and report["logits_max_abs_diff"] < 1e-5
    assert len(report["layers"]) == 2 and all(row["cosine"] > 0.999999 for row in report["layers"])
    assert report["tokenized_by"].startswith("prompt bytes")  # the tiny model has no tokenizer


def test_compare_text_and_errors(qwen2, tmp_path, capsys):
    assert main(["compare", str(qwen2)]) == 0
    assert "top-1 agreement   100.0%" in capsys.readouterr().out
    main(["convert", str(qwen2), str(tmp_path / "mine")])
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "mine")]) == 2
    assert "compare needs the Hugging Face directory or GGUF file" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "nothing"), str(tmp_path / "x")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_compare_rejects_a_tokenizer_that_does_not_fit(qwen2_with_tokenizer, capsys):
    assert main(["compare", str(qwen2_with_tokenizer), "--prompt", "question"]) == 2
    assert "outside the model's vocabulary of 96" in capsys.readouterr().err
