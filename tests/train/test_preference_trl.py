"""llmkit's preference losses against TRL's DPOTrainer: the same two tiny models (a policy and a reference, different
weights) in both libraries, TRL's own batch of pairs (its tokenization, its completion masks), and TRL's loss, rewards
and gradients against llmkit's answer_logps and preference_loss on the same tokens."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from helpers import tiny_tokenizer

import llmkit
from llmkit.interop.hf import save_hf
from llmkit.train.preference import Pairs, answer_logps, preference_loss

trl = pytest.importorskip("trl", reason="the comparison needs TRL (pip install trl)")
pytestmark = pytest.mark.slow  # TRL, datasets and transformers to import

PAIRS = [
    {"prompt": "to be or", "chosen": " not to be", "rejected": " that is"},
    {"prompt": "that is the", "chosen": " question", "rejected": " to be or not to be"},
    {"prompt": "not to", "chosen": " be, that is", "rejected": " question"},
]


def _trl_side(tmp_path: Path, loss_type: str, beta: float) -> tuple[dict, torch.Tensor, dict, object, object]:
    """TRL's batch, loss and logged metrics, with the policy's gradients after backward; and llmkit's two models."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    tok = tiny_tokenizer()
    cfg = dataclasses.replace(llmkit.get_preset("llama2-7b-tiny"), vocab_size=tok.vocab_size)
    torch.manual_seed(0)
    policy = llmkit.build_model(cfg)
    torch.manual_seed(1)
    reference = llmkit.build_model(cfg).eval()
    save_hf(policy, tmp_path / "policy")
    save_hf(reference, tmp_path / "reference")
    name = tok.backend.id_to_token
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok.backend, bos_token=name(0), eos_token=name(1),
                                     pad_token=name(1))  # fmt: skip
    args = trl.DPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=len(PAIRS), beta=beta,
                         loss_type=[loss_type], report_to="none", use_cpu=True, max_length=64, bf16=False,
                         save_strategy="no")  # fmt: skip
    hf_policy = AutoModelForCausalLM.from_pretrained(tmp_path / "policy", dtype=torch.float32)
    hf_reference = AutoModelForCausalLM.from_pretrained(tmp_path / "reference", dtype=torch.float32)
    trainer = trl.DPOTrainer(model=hf_policy, ref_model=hf_reference, args=args,
                             train_dataset=Dataset.from_list(PAIRS), processing_class=hf_tok)  # fmt: skip
    batch = next(iter(trainer.get_train_dataloader()))
    hf_policy.train()
    loss = trainer.compute_loss(hf_policy, batch)
    loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    models = {"grads": dict(hf_policy.named_parameters()), "hf": (hf_policy, hf_reference)}
    return batch, loss.detach(), metrics | models, policy, reference


def _pairs(logits: torch.Tensor, batch: dict) -> Pairs:
    """The batch's rows (TRL's: the chosen answers, then the rejected) from a model's logits: each row's summed
    log-probability of its completion's tokens (the mask's), and their count."""
    ids, mask = batch["input_ids"], batch["completion_mask"].bool()
    targets = ids[:, 1:].masked_fill(~mask[:, 1:], -100)
    logps, counts = answer_logps(logits[:, :-1], targets)
    (chosen, rejected), (n_chosen, n_rejected) = logps.chunk(2), counts.chunk(2)
    return Pairs(chosen, rejected, n_chosen, n_rejected)


@pytest.mark.parametrize(("loss_type", "kind"), [("sigmoid", "dpo"), ("ipo", "ipo")])
def test_the_loss_rewards_and_gradients_equal_trl_s_dpo_trainer(tmp_path, loss_type, kind):
    beta = 0.1
    batch, trl_loss, trl, policy, reference = _trl_side(tmp_path, loss_type, beta)
    keys = ("reward_chosen", "rewards/chosen"), ("reward_rejected", "rewards/rejected"), ("reward_margin",
            "rewards/margins"), ("reward_accuracy", "rewards/accuracies")  # fmt: skip

    # the loss function on identical log-probabilities: the HF models' logits, as TRL's forward computes them
    hf_policy, hf_reference = trl["hf"]
    with torch.no_grad():
        same = preference_loss(kind, _pairs(hf_policy(batch["input_ids"]).logits, batch),
                               _pairs(hf_reference(batch["input_ids"]).logits, batch), beta)  # fmt: skip
    torch.testing.assert_close(same["loss"], trl_loss, rtol=1e-6, atol=1e-7)
    for ours, theirs in keys:
        assert same[ours].item() == pytest.approx(trl[theirs], rel=1e-5, abs=1e-7)
    assert 0 < trl["rewards/accuracies"] < 1 or kind == "ipo"  # the pairs are neither all won nor all lost

    # and through llmkit's own models (the same weights; in fp32 their logits equal transformers' here: bf16=False
    # above, or TRL would run the reference under accelerate's bf16 autocast)
    with torch.no_grad():
        ref = _pairs(reference(batch["input_ids"]), batch)
    out = preference_loss(kind, _pairs(policy(batch["input_ids"]), batch), ref, beta)
    out["loss"].backward()
    torch.testing.assert_close(out["loss"], trl_loss, rtol=1e-6, atol=1e-7)
    for ours, theirs in keys:
        assert out[ours].item() == pytest.approx(trl[theirs], rel=1e-5, abs=1e-7)
    # the gradients, on weights the conversion does not permute (RoPE's q / k rows are)
    grads = trl["grads"]
    for ours, theirs in (("head.weight", "lm_head.weight"), ("embed.weight", "model.embed_tokens.weight"),
                         ("blocks.0.ffn.w2.weight", "model.layers.0.mlp.down_proj.weight"),
                         ("blocks.1.attn.wv.weight", "model.layers.1.self_attn.v_proj.weight")):  # fmt: skip
        g, expected = policy.get_parameter(ours).grad, grads[theirs].grad
        assert (g - expected).norm() <= 1e-5 * expected.norm(), ours
