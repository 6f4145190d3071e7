"""Fine-tuning and drafter training on a CUDA GPU: LoRA and QLoRA runs from a checkpoint, chat SFT, the grafted MTP
module taught on the model's own text (library and `llmkit graft-mtp --device cuda`), and decoding with it on the
GPU. Skipped without a GPU (CI has none; these ran on an H100)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from llmkit import build_model, get_preset
from llmkit.cli import main
from llmkit.interop.load import load_model
from llmkit.runs import resolve_checkpoint
from llmkit.train.config import TrainConfig
from llmkit.train.loop import Trainer, train

from .conftest import losses, tiny_config, train_on_own_text

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def pretrained(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("pre") / "run"
    train(TrainConfig.from_dict(tiny_config(tiny_data, out, train={"steps": 30})))  # on the CPU
    return out


@pytest.fixture(autouse=True)
def no_tf32():
    """Greedy tokens are compared across decoding paths: no TF32 rounding in between."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def gpu_lora_config(data: Path, out: Path, base: Path, precision: str, **lora: object) -> dict:
    cfg = tiny_config(data, out, train={"steps": 10, "save_every": 5, "eval_every": 5})
    cfg["model"] = {"checkpoint": str(base)}
    cfg["lora"] = {"r": 4, "alpha": 8, "targets": ["wq", "wv", "w2"], **lora}
    cfg["optim"]["lr"] = 1e-2
    cfg["train"].update({"device": "cuda", "precision": precision})
    return cfg


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_gpu_lora_run_trains_only_adapters_resumes_exactly_and_merges(tiny_data, pretrained, tmp_path, precision):
    cfg = gpu_lora_config(tiny_data, tmp_path / "a", pretrained, precision)
    trainer = Trainer(TrainConfig.from_dict(cfg))
    assert next(trainer.model.parameters()).device.type == "cuda"
    before = {k: v.clone() for k, v in trainer.model.state_dict().items() if ".lora." not in k}
    trainer.run()
    trainer.close()
    after = trainer.model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())  # the base is frozen
    assert losses(tmp_path / "a")[-1] < losses(tmp_path / "a")[0]
    b = gpu_lora_config(tiny_data, tmp_path / "b", pretrained, precision)
    train(TrainConfig.from_dict({**b, "train": {**b["train"], "halt_at": 5}}))
    train(TrainConfig.from_dict(b), resume=True)
    assert losses(tmp_path / "a") == losses(tmp_path / "b")  # resumed on the GPU: the same run
    x = torch.randint(0, 320, (2, 16), device="cuda")
    with torch.no_grad():
        expected = trainer.model.eval().float()(x)
    assert main(["merge", str(tmp_path / "a"), str(tmp_path / "merged")]) == 0
    merged = load_model(tmp_path / "merged", device="cuda").model.eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(x), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_gpu_qlora_trains_adapters_on_quantized_weights(tiny_data, pretrained, tmp_path, method):
    from llmkit.interop.checkpoint import save_llmkit
    from llmkit.quant import quantize

    loaded = load_model(resolve_checkpoint(pretrained))
    save_llmkit(
        quantize(loaded.model, method, group_size=32 if method == "int4" else None),
        tmp_path / "q",
        tokenizer=loaded.tokenizer,
    )
    cfg = gpu_lora_config(tiny_data, tmp_path / "r", tmp_path / "q", "bf16", quantized=True)
    result = train(TrainConfig.from_dict(cfg))
    assert result.steps == 10 and losses(tmp_path / "r")[-1] < losses(tmp_path / "r")[0]


def test_gpu_chat_sft_starts_at_the_loaded_models_loss_and_learns(pretrained, tmp_path):
    import torch.nn.functional as F

    from llmkit.data.chat import prepare_chat
    from llmkit.tokenizer import Tokenizer
    from llmkit.train.parallel import setup
    from llmkit.train.tasks import ChatTask

    from .test_chat import TEMPLATE, conversation

    tok = Tokenizer.from_dir(resolve_checkpoint(pretrained))
    assert tok is not None
    tok.chat_template = TEMPLATE
    tok.save(tmp_path / "tok")
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(conversation(k)) + "\n" for k in range(60)))
    prepare_chat(tmp_path / "c.jsonl", tmp_path / "data", tokenizer=tmp_path / "tok", val_fraction=0.1, progress=False)
    cfg = tiny_config(tmp_path / "data", tmp_path / "ft", data={"seq_len": 240, "batch_size": 2}, train={"steps": 12})
    cfg["model"] = {"checkpoint": str(pretrained)}
    cfg["train"]["device"] = "cuda"
    train(TrainConfig.from_dict(cfg))
    (x, y, seg), _ = ChatTask(TrainConfig.from_dict(cfg), setup("none", "cuda")).batch(0, 0)
    model = load_model(resolve_checkpoint(pretrained), device="cuda").model.eval()
    with torch.no_grad():
        logits = model(x.cuda(), segments=seg.cuda())
        expected = F.cross_entropy(logits.flatten(0, 1), y.cuda().flatten(), ignore_index=-100).item()
    first = losses(tmp_path / "ft")
    assert first[0] == pytest.approx(expected, abs=1e-4) and first[-1] < first[0]


def test_gpu_grafted_module_learns_to_agree_and_chains_exactly(tmp_path):
    from llmkit.generate import generate, speculative_generate
    from llmkit.train.drafting import evaluate_drafter
    from llmkit.train.graft import graft_mtp
    from llmkit.train.own_text import model_states

    torch.manual_seed(0)
    model = build_model(dataclasses.replace(get_preset("llama2-7b-tiny"), vocab_size=64), device="cuda").eval()
    generator = torch.Generator().manual_seed(1)
    text = model_states(model, torch.randint(0, 64, (96, 24), generator=generator))  # kept on the CPU
    held = model_states(model, torch.randint(0, 64, (16, 24), generator=generator))
    assert text.tokens.device.type == "cpu"
    grafted = graft_mtp(model)
    before, _ = evaluate_drafter(grafted, held, 2)
    train_on_own_text(grafted, text, held, tmp_path, steps=150, lr=1e-2, device="cuda", unroll=2)
    assert next(grafted.parameters()).device.type == "cuda"
    agreement, _ = evaluate_drafter(grafted, held, 2)
    assert min(agreement) > max(before) + 0.3
    prompts = held.tokens[:3, :10].tolist()
    with torch.no_grad():
        plain = generate(grafted, prompts, max_new_tokens=30).new_tokens
        for k in (1, 3):
            assert speculative_generate(grafted, prompts, max_new_tokens=30, k=k).new_tokens == plain


def test_gpu_pruned_draft_distils_on_the_gpu(tmp_path):
    from llmkit.train.drafting import agreement
    from llmkit.train.graft import prune
    from llmkit.train.own_text import model_states

    torch.manual_seed(0)
    model = build_model(dataclasses.replace(get_preset("llama2-7b-tiny"), vocab_size=64, n_layers=4), device="cuda")
    with torch.no_grad():
        model.head.weight.mul_(8)  # type: ignore[union-attr]
    generator = torch.Generator().manual_seed(1)
    text = model_states(model.eval(), torch.randint(0, 64, (64, 24), generator=generator))
    draft = prune(model, [0, 3])
    before, _ = agreement(draft, text, 2)
    train_on_own_text(draft, text, text, tmp_path, steps=120, lr=3e-3, device="cuda")
    assert agreement(draft, text, 2)[0] > before + 0.1


def test_gpu_graft_mtp_command_and_generate_with_it(pretrained, tiny_data, tmp_path, capsys):
    out = tmp_path / "drafting"
    args = [str(resolve_checkpoint(pretrained)), str(out), "--data", str(tiny_data), "--sequences", "8"]
    flags = ["--opening", "8", "--new-tokens", "16", "--minutes", "0.05", "--unroll", "2", "--device", "cuda"]
    assert main(["graft-mtp", *args, *flags]) == 0
    assert "agree with the model" in capsys.readouterr().out
    common = ["generate", str(out), "--prompt", "ROMEO", "--max-new-tokens", "24", "--temperature", "0"]
    common += ["--device", "cuda"]
    assert main(common) == 0
    plain = capsys.readouterr().out
    assert main([*common, "--mtp", "--speculate", "2"]) == 0
    assert capsys.readouterr().out == plain  # greedy with the module's drafts: the same text


def test_gpu_distill_draft_command_and_speculation_with_it(pretrained, tiny_data, tmp_path, capsys):
    base = str(resolve_checkpoint(pretrained))
    out = tmp_path / "draft"
    flags = ["--data", str(tiny_data), "--sequences", "8", "--opening", "8", "--new-tokens", "16", "--minutes", "0.05"]
    assert main(["distill-draft", base, str(out), *flags, "--keep", "-1", "--device", "cuda"]) == 0
    assert "agrees with the model" in capsys.readouterr().out
    common = ["generate", base, "--prompt", "ROMEO", "--max-new-tokens", "24", "--temperature", "0", "--device", "cuda"]
    assert main(common) == 0
    plain = capsys.readouterr().out
    assert main([*common, "--draft", str(out), "--speculate", "3"]) == 0
    assert capsys.readouterr().out == plain
