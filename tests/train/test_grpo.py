"""GRPO (llmkit.train.grpo): the advantages and the clipped loss on hand-computed groups, the rewards, the engine's
rollout log-probabilities equal to the trainer's to the bit for completions of different lengths, and a tiny model
whose reward rises on a trivially learnable reward in the training loop (and resumes to the same weights)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from helpers import tiny_tokenizer

from llmkit.errors import ConfigError, InputError
from llmkit.interop.load import load_model
from llmkit.runs import latest_checkpoint
from llmkit.serve.model_runner import InvariantRunner
from llmkit.tokenizer import Tokenizer
from llmkit.train.config import RLConfig, TrainConfig
from llmkit.train.grpo import (
    GRPOModule,
    Sampler,
    group_advantages,
    policy_loss,
    read_prompts,
    rollout_rows,
    token_logps,
)
from llmkit.train.loop import train
from llmkit.train.rewards import Completion, extract_answer, resolve_reward

from .conftest import losses, with_sections

# ---- the arithmetic, by hand


def test_group_advantages_by_hand():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    std = math.sqrt(4 * 0.25 / 3)  # the unbiased standard deviation of (1, 0, 0, 1)
    a, half = group_advantages(rewards), 0.5 / (std + 1e-4)
    assert a[0].tolist() == pytest.approx([half, -half, -half, half])
    assert a[1].tolist() == [0.0] * 4  # a group whose rewards are all equal teaches nothing
    assert group_advantages(rewards, scale=False)[0].tolist() == [0.5, -0.5, -0.5, 0.5]  # Dr. GRPO


def _hand_case() -> dict:
    """Two completions: the first (advantage +1) of two tokens with ratios 1.5 and 0.9, the second (advantage -1) of
    one token with ratio 0.7 (its second position is padding)."""
    old = torch.zeros(2, 2)
    logps = torch.tensor([[math.log(1.5), math.log(0.9)], [math.log(0.7), 5.0]], requires_grad=True)
    return {"logps": logps, "old_logps": old, "advantages": torch.tensor([1.0, -1.0]),
            "mask": torch.tensor([[True, True], [True, False]])}  # fmt: skip


def test_the_clipped_loss_and_its_normalisations_by_hand():
    # per token: -min(1.5, 1.2) = -1.2 and -min(0.9, 0.9) = -0.9 (advantage +1); -min(-0.7, -0.8) = 0.8 (advantage -1)
    case = _hand_case()
    out = policy_loss(**case, clip=0.2)
    assert out["loss"].item() == pytest.approx(((-1.2 - 0.9) / 2 + 0.8) / 2)  # GRPO: per completion, then mean
    assert float(out["clip_fraction"]) == pytest.approx(2 / 3)  # 1.5 above 1.2 (A > 0), 0.7 below 0.8 (A < 0)
    assert policy_loss(**case, normalise="token")["loss"].item() == pytest.approx((-1.2 - 0.9 + 0.8) / 3)  # DAPO
    constant = policy_loss(**case, normalise="constant", max_tokens=4)["loss"]
    assert constant.item() == pytest.approx((-1.2 - 0.9 + 0.8) / (2 * 4))  # Dr. GRPO
    high = policy_loss(**case, clip=0.2, clip_high=0.6)["loss"]  # DAPO's clip-higher lets 1.5 through
    assert high.item() == pytest.approx(((-1.5 - 0.9) / 2 + 0.8) / 2)
    # the gradient: only the unclipped token moves, by -A ratio / its completion's tokens / completions
    out["loss"].backward()
    grad = case["logps"].grad
    torch.testing.assert_close(grad, torch.tensor([[0.0, -0.9 / 2 / 2], [0.0, 0.0]]))


def test_the_kl_term_by_hand():
    case = _hand_case()
    ref = case["logps"].detach() + torch.tensor([[0.1, -0.2], [0.3, 0.0]])
    with_kl = policy_loss(**case, kl_beta=0.5, ref_logps=ref)
    k3 = [math.exp(d) - d - 1 for d in (0.1, -0.2, 0.3)]
    assert float(with_kl["kl"]) == pytest.approx(sum(k3) / 3)
    expected = ((-1.2 + 0.5 * k3[0] - 0.9 + 0.5 * k3[1]) / 2 + (0.8 + 0.5 * k3[2])) / 2
    assert with_kl["loss"].item() == pytest.approx(expected)
    with pytest.raises(ValueError, match="reference"):
        policy_loss(**case, kl_beta=0.5)


# ---- rewards


def _done(text: str, tokens: int = 5, finish: str = "stop") -> Completion:
    return Completion("prompt", text, tokens, finish)


def test_the_built_in_rewards():
    exact = resolve_reward("exact_answer")
    assert extract_answer("so 12, then 13") == "13" and extract_answer("The answer is: 42.") == "42"
    assert extract_answer("work... #### 1,000") == "1,000" and extract_answer(r"thus \boxed{7/2}") == "7/2"
    assert exact(_done("#### 1,000"), {"answer": 1000}) == 1.0 and exact(_done("it is 12"), {"answer": "13"}) == 0.0
    assert exact(_done("no number"), {"answer": 3}) == 0.0 and exact(_done("Answer: Paris"), {"answer": "Paris"}) == 1
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    check = resolve_reward("json_schema")
    assert check(_done('{"n": 3}'), {"schema": schema}) == 1.0
    assert check(_done('{"n": "3"}'), {"schema": schema}) == 0.0 and check(_done("{n"), {"schema": schema}) == 0.0
    assert resolve_reward("format")(_done(" <a>1</a> "), {"format": r"<a>\d+</a>"}) == 1.0
    assert resolve_reward("format")(_done("<a>x</a>"), {"format": r"<a>\d+</a>"}) == 0.0
    assert resolve_reward("length_penalty")(_done("", tokens=96), {"target_tokens": 64}) == -0.5
    assert resolve_reward("length_penalty")(_done("", tokens=10), {}) == 0.0
    assert resolve_reward("finished")(_done("", finish="length"), {}) == 0.0
    assert resolve_reward(VOWELS) is vowel_share
    with pytest.raises(ConfigError, match="no reward named"):
        resolve_reward("nope")
    with pytest.raises(ConfigError, match='needs an "answer" field'):
        exact(_done("1"), {})


def vowel_share(completion: Completion, example: dict) -> float:
    """A reward a tiny random model can learn quickly: the share of the completion's characters that are 'e' or 'o'."""
    text = completion.text
    return sum(c in "eo" for c in text) / max(len(text), 1)


VOWELS = f"{__name__}:vowel_share"  # (the module as pytest imported it)

# ---- the engine and the trainer


@pytest.fixture(scope="module")
def checkpoint(random_checkpoint: Path) -> Path:
    return random_checkpoint


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    words = ["to be", "or not", "to be, that", "is the question", "not to", "be or"]
    path = tmp_path_factory.mktemp("rl") / "prompts.jsonl"
    lines = [{"prompt": f"{k}: " + words[k % 6] * (8 + k % 3), "answer": k} for k in range(40)]  # 2+ cache blocks
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_engines_rollout_log_probabilities_are_the_trainers_to_the_bit(checkpoint, prompts, temperature):
    """Rollouts of different lengths (some end on their own, some run out of tokens), sampled in one batch: the
    log-probabilities the trainer's loss sees (the engine's scores of the finished texts, all together) are the
    floats the engine sampled them with, so the first ratio is exactly 1; PyTorch's forward, which gives the
    gradient, agrees to ~1e-5; the loss's gradient is PyTorch's."""
    model = load_model(checkpoint, dtype=torch.float32).model
    tok = Tokenizer.from_dir(checkpoint)
    head = model.embed.weight if model.head is None else model.head.weight
    with torch.no_grad():  # an end token likely at some positions, unlikely at others: completions of many lengths
        head[tok.eos_id] *= 30
    rl = RLConfig(prompts=str(prompts), group=4, max_new_tokens=12, rewards=[VOWELS], temperature=temperature)
    sampler = Sampler(model, tok, read_prompts(str(prompts), tok, 0.0), rl)
    if not isinstance(sampler.engine.runner, InvariantRunner):
        pytest.skip("llmkit's C++ step is not available here")
    rollouts = sampler.rollouts([0, 5, 9, 14], seed=11)
    lengths = {len(c) for c in rollouts.completions}
    assert len(lengths) > 1, lengths
    scored = sampler.score(rollouts.prompts, rollouts.completions)
    assert scored == rollouts.logprobs  # every float the same
    rows = list(range(len(rollouts)))
    inputs, targets, old, values = rollout_rows(rollouts, rows, 0, scored)
    module = GRPOModule(model, sampler, rl, None)
    stats = torch.zeros(3)
    out = module(inputs, targets, old, values, rollouts.advantages, stats)
    assert float(out["clip_fraction"]) == 0.0 and 0.0 < float(out["logp_gap"]) < 1e-4
    out["loss"].backward()
    engine_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    # the same loss on PyTorch's log-probabilities alone: the same gradient (the ratio is 1 either way, to 1e-5)
    torch_logps = token_logps(model(inputs) / temperature, targets)
    policy_loss(torch_logps, torch_logps.detach(), rollouts.advantages, targets != -100)["loss"].backward()
    for a, p in zip(engine_grads, model.parameters(), strict=True):
        torch.testing.assert_close(a, p.grad, rtol=1e-4, atol=1e-6)
    # once the weights change, the engine's scores and its new rollouts follow them: the prompts' cached blocks,
    # computed with the old weights, were dropped
    assert sampler.engine.pool.cached(), "the prompts are long enough to leave cached blocks"
    with torch.no_grad():
        model.blocks[0].attn.wq.weight.mul_(1.5)
    sampler.engine.weights_changed()
    moved = sampler.score(rollouts.prompts, rollouts.completions)
    with torch.no_grad():
        expected = token_logps(model(inputs) / temperature, targets)
    mask = targets != -100
    assert (expected[mask] - torch.tensor([v for row in moved for v in row])).abs().max() < 1e-4
    again = sampler.rollouts([0, 5, 9, 14], seed=12)
    assert sampler.score(again.prompts, again.completions) == again.logprobs


def _config(checkpoint: Path, prompts: Path, out: Path, steps: int, **sections: dict) -> TrainConfig:
    cfg: dict = {
        "model": {"checkpoint": str(checkpoint)},
        "data": {"batch_size": 4},
        "optim": {"lr": 1e-2, "weight_decay": 0.0},
        "schedule": {"warmup_steps": 2, "kind": "constant"},
        "rl": {"prompts": str(prompts), "group": 8, "max_new_tokens": 8,
               "rewards": [VOWELS], "eval_prompts": 8, "kv_memory": 64 << 20},
        "train": {"steps": steps, "log_every": 1, "eval_every": steps, "save_every": steps, "progress": False,
                  "out": str(out)},
    }  # fmt: skip
    return TrainConfig.from_dict(with_sections(cfg, sections))


def test_a_tiny_models_reward_rises_in_the_training_loop(checkpoint, prompts, tmp_path):
    """On a reward the model can learn in a few steps (the share of 'e' and 'o' in its text), the rollouts' mean
    reward over the last steps is well above the first steps'; the evaluation reports the greedy answers' reward."""
    train(_config(checkpoint, prompts, tmp_path / "run", steps=20))
    rewards = losses(tmp_path / "run", "reward")
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert last > first + 0.1 and last > 2 * first, (first, last)
    assert losses(tmp_path / "run", f"val_reward_{VOWELS}")


def test_a_grpo_run_resumes_to_the_same_weights(checkpoint, prompts, tmp_path):
    whole = train(_config(checkpoint, prompts, tmp_path / "a", steps=4, train={"save_every": 2}))
    train(_config(checkpoint, prompts, tmp_path / "b", steps=4, train={"save_every": 2, "halt_at": 2}))
    resumed = train(_config(checkpoint, prompts, tmp_path / "b", steps=4, train={"save_every": 2}), resume=True)
    assert whole.checkpoint is not None and resumed.checkpoint is not None
    a = load_model(latest_checkpoint(tmp_path / "a"), dtype=torch.float32).model.state_dict()
    b = load_model(latest_checkpoint(tmp_path / "b"), dtype=torch.float32).model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert losses(tmp_path / "a", "reward")[2:] == losses(tmp_path / "b", "reward")[-2:]


def test_bad_rl_settings_are_clear_errors(checkpoint, prompts, tmp_path):
    with pytest.raises(ConfigError, match=r"set model\.checkpoint"):
        TrainConfig.from_dict({"rl": {"prompts": str(prompts)}})
    with pytest.raises(ConfigError, match="one weight per reward"):
        RLConfig(prompts="p", rewards=["finished"], reward_weights=[1.0, 2.0])
    (tmp_path / "bad.jsonl").write_text('{"answer": 1}\n')
    with pytest.raises(InputError, match=re.escape('bad.jsonl:1: expected an object with a "prompt"')):
        train(_config(checkpoint, tmp_path / "bad.jsonl", tmp_path / "run", steps=2))
    with pytest.raises(ConfigError, match="no reward named"):
        train(_config(checkpoint, prompts, tmp_path / "run2", steps=2, rl={"rewards": ["nope"]}))


def test_a_reward_model_scores_the_prompt_and_completion(tmp_path):
    """rl.reward_model: a Hugging Face sequence-classification checkpoint's first logit for prompt + completion."""
    transformers = pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForSequenceClassification, PreTrainedTokenizerFast

    from llmkit.train.rewards import RewardModel

    tok = tiny_tokenizer()
    name = tok.backend.id_to_token
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok.backend, eos_token=name(1), pad_token=name(1))
    config = LlamaConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_labels=1, pad_token_id=1)  # fmt: skip
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(tmp_path / "rm")
    hf_tok.save_pretrained(tmp_path / "rm")
    scorer = RewardModel(str(tmp_path / "rm"))
    model = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm").eval()
    for completion in ("to be", "not to be, that is"):
        with torch.no_grad():
            expected = model(**hf_tok("or " + completion, return_tensors="pt")).logits[0, 0].item()
        assert scorer(Completion("or ", completion, 3, "stop"), {}) == pytest.approx(expected, abs=1e-6)
    assert len({scorer(Completion("or ", c, 3, "stop"), {}) for c in ("to be", "not to be")}) == 2


def test_iterations_reuse_each_batch_of_rollouts(checkpoint, prompts, tmp_path):
    """rl.iterations=2: every second step trains again on the rollouts before it (the same rewards), their
    log-probabilities scored again under the moved weights, so the ratio leaves 1 (here the updates are large enough
    for some tokens to be clipped)."""
    train(_config(checkpoint, prompts, tmp_path / "run", steps=6, rl={"iterations": 2}, optim={"lr": 3e-2}))
    rewards = losses(tmp_path / "run", "reward")
    assert rewards[0::2] == rewards[1::2] and rewards[0] != rewards[2]
    clipped = losses(tmp_path / "run", "clip_fraction")
    assert all(c == 0.0 for c in clipped[0::2]) and any(c > 0.0 for c in clipped[1::2])


def test_grpo_with_lora_trains_the_adapters(checkpoint, prompts, tmp_path):
    """LoRA's hooks keep the model off the C++ step, so the engine samples through PyTorch (the log-probabilities
    are still the engine's own); only the adapters train and are saved."""
    result = train(_config(checkpoint, prompts, tmp_path / "run", steps=3, lora={"r": 4, "alpha": 8}))
    assert result.checkpoint is not None and (result.checkpoint / "adapter_model.safetensors").is_file()
    assert len(losses(tmp_path / "run", "reward")) == 3
