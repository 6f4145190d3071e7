"""Group Relative Policy Optimisation (GRPO; Shao et al. 2024, "DeepSeekMath", section 4.1) on llmkit's own serving
engine: reinforcement learning from rewards a program can check.

One step of the loop (GRPOTask in tasks.py) with P = data.batch_size prompts and G = rl.group:

    rollouts      the engine (llmkit.serve.engine.Engine) samples G completions of each prompt (n = G, seeded by the
                  step), batched over its paged cache, from the model being trained: the engine runs the trainer's
                  own parameters (its C++ step reads the model's tensors in place, nothing is copied), so after an
                  optimizer step the next rollouts come from the new weights at no cost; the engine's cached
                  prefixes are dropped then (Engine.weights_changed)
                  at rl.temperature: the policy pi is the model's logits over the temperature (as TRL's GRPOTrainer
                  and vLLM's processed log-probabilities have it), and the engine reports those log-probabilities
    rewards       each completion's reward (rewards.py), the weighted sum of the named functions
    advantages    within each group: A_i = (r_i - mean(r)) / std(r) (GRPO, eq. 3's outcome supervision), or without
                  the division (Dr. GRPO: Liu et al. 2025, "Understanding R1-Zero-Like Training", which shows the
                  division favours questions that are too easy or too hard); a group whose rewards are all equal
                  teaches nothing (its advantages are 0)
    loss          PPO's clipped objective per completion token (Schulman et al. 2017), ratio = pi(o_t) / pi_old(o_t):
                      -min(ratio A, clip(ratio, 1 - clip, 1 + clip_high) A) + kl_beta KL_t
                  KL_t = pi_ref/pi - log(pi_ref/pi) - 1, the unbiased estimator GRPO uses (eq. 4; Schulman 2020's k3),
                  to the model the run started from (kept in memory only when kl_beta > 0). DAPO's clip-higher (Yu et
                  al. 2025, "DAPO", eq. 10) widens the range above 1. rl.normalise averages the tokens' losses:
                      sequence   over each completion's tokens, then over completions (GRPO, eq. 3)
                      token      over all the batch's completion tokens (DAPO, eq. 8: long answers count per token)
                      constant   summed, over completions x rl.max_new_tokens (Dr. GRPO: no length bias)
                  rl.iterations (GRPO's mu) optimizer steps reuse one batch of rollouts; pi_old is the model that
                  sampled them.

The log-probabilities are the engine's, to the bit. pi_old(o_t) is what the engine reported when it sampled o_t;
pi(o_t) is what the same engine computes for the finished texts under the current weights (each text scored as a
prompt: prompt_logprobs). In the engine's batch-invariant mode (the C++ step, the default on CPUs where the model
lowers to it) a token's bits do not depend on the batch, the chunking or whether the token was generated or given,
so at the first iteration ratio = 1 exactly, not 1 +- 1e-5: the policy ratio is not biased by two programs computing
the same model differently (the issue torchtitan's RL work fixed for vLLM). At the first iteration the values are the
rollout's own (scoring the texts again gives the same bits, which tests/train/test_grpo.py checks); later ones
(rl.iterations > 1) score the texts under the updated weights. The gradient comes from the PyTorch
forward of the same model, added as (logp_torch - logp_torch.detach()), which is exactly zero in value: the loss
sees the engine's numbers and differentiates PyTorch's. The two agree to ~1e-5 (logged as logp_gap). A model that
does not lower to the C++ step (LoRA's hooks, bf16, a GPU without --batch-invariant) samples through PyTorch; the
values are still the engine's own, but a token generated and the same token scored may then differ by rounding.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor, nn

from llmkit.errors import InputError
from llmkit.models import DecoderLM
from llmkit.serve.config import EngineConfig
from llmkit.serve.engine import Engine
from llmkit.serve.request import SamplingParams
from llmkit.tokenizer import Tokenizer, render_chat
from llmkit.train.config import RLConfig
from llmkit.train.rewards import Completion, RewardFn, RewardModel, resolve_reward

Normalise = Literal["sequence", "token", "constant"]
TERMS = ("loss", "reward", "reward_std", "advantage", "clip_fraction", "kl", "completion_tokens", "logp_gap")


def group_advantages(rewards: Tensor, scale: bool = True, eps: float = 1e-4) -> Tensor:
    """rewards (P, G), a group a row -> advantages (P, G): each reward minus its group's mean, divided by the group's
    standard deviation (the unbiased one, as TRL's GRPOTrainer) plus eps when `scale`."""
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if not scale:
        return centred
    return centred / (rewards.std(dim=1, keepdim=True) + eps)


def policy_loss(
    logps: Tensor,
    old_logps: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip: float = 0.2,
    clip_high: float | None = None,
    kl_beta: float = 0.0,
    ref_logps: Tensor | None = None,
    normalise: Normalise = "sequence",
    max_tokens: int | None = None,
) -> dict[str, Tensor]:
    """GRPO's loss (module docstring) and its metrics. logps, old_logps, ref_logps (N, T): each completion token's
    log-probability under the policy, the sampling policy and the reference; advantages (N,); mask (N, T) bool: the
    completion's tokens. max_tokens: the constant of normalise="constant"."""
    mask = mask.to(logps.dtype)
    ratio = torch.exp(logps - old_logps)
    high = clip if clip_high is None else clip_high
    a = advantages[:, None]
    per_token = -torch.min(ratio * a, ratio.clamp(1 - clip, 1 + high) * a)
    kl = torch.zeros_like(logps)
    if kl_beta:
        if ref_logps is None:
            raise ValueError("kl_beta > 0 needs the reference's log-probabilities")
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1
        per_token = per_token + kl_beta * kl
    counts = mask.sum(dim=1).clamp(min=1)
    if normalise == "sequence":
        loss = ((per_token * mask).sum(dim=1) / counts).mean()
    elif normalise == "token":
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1)
    else:
        if max_tokens is None:
            raise ValueError('normalise="constant" needs max_tokens')
        loss = (per_token * mask).sum() / (logps.shape[0] * max_tokens)
    clipped = ((ratio < 1 - clip) & (a < 0)) | ((ratio > 1 + high) & (a > 0))
    tokens = mask.sum().clamp(min=1)
    return {
        "loss": loss,
        "clip_fraction": (clipped.to(mask.dtype) * mask).sum().detach() / tokens,
        "kl": (kl * mask).sum().detach() / tokens,
    }


def token_logps(logits: Tensor, targets: Tensor) -> Tensor:
    """Each position's log-probability of its target (logits (N, T, V), targets (N, T), -100: none) in fp32, 0 where
    there is none: (N, T)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    picked = logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return picked * (targets != -100)


def completion_logps(model: DecoderLM, inputs: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """token_logps of the model's logits over `temperature`, with the output head applied at the targets' positions
    only: a completion's prompt (most of its tokens, in short answers) goes through the blocks but not the head,
    whose V columns cost as much as several blocks."""
    h = model.run(inputs, model.step_for(inputs, None, None, None))
    mask = targets != -100
    logits = model.logits(model.norm(h[mask])).float() / temperature  # (M, V)
    picked = torch.log_softmax(logits, dim=-1).gather(-1, targets[mask].unsqueeze(-1)).squeeze(-1)
    return torch.zeros(targets.shape, dtype=picked.dtype, device=picked.device).masked_scatter(mask, picked)


# ---- prompts and rollouts


@dataclass(frozen=True)
class Example:
    """One line of rl.prompts: its prompt as the model reads it, as text (for the rewards), and every field."""

    ids: list[int]
    text: str
    fields: dict[str, Any]


def read_prompts(path: str, tokenizer: Tokenizer, val_fraction: float) -> dict[str, list[Example]]:
    """The lines of a .jsonl file of prompts, split into train and val by a hash of each line: a "prompt" that is a
    string is read as text, a list of messages is rendered with the chat template (with the generation prompt)."""
    file = Path(path)
    if not file.is_file():
        raise InputError(f"rl.prompts: {file} does not exist (expected a .jsonl file of prompts)")
    splits: dict[str, list[Example]] = {"train": [], "val": []}
    for n, line in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{file}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
        prompt = obj.get("prompt") if isinstance(obj, dict) else None
        if isinstance(prompt, str) and prompt:
            text, ids = prompt, tokenizer.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            if not tokenizer.chat_template:
                raise InputError(f"{where}: a prompt of messages needs a chat template, and the tokenizer has none")
            text = render_chat(tokenizer, prompt, add_generation_prompt=True)
            ids = tokenizer.backend.encode(text, add_special_tokens=False).ids
        else:
            raise InputError(f'{where}: expected an object with a "prompt": a string or a list of messages')
        h = int.from_bytes(hashlib.sha256(line.strip().encode()).digest()[:8], "little")
        splits["val" if h / 2**64 < val_fraction else "train"].append(Example(list(ids), text, obj))
    if not splits["train"]:
        raise InputError(f"rl.prompts: {file} holds no training prompts")
    return splits


@dataclass
class Rollouts:
    """A step's completions: sequence i answers example examples[i]; tokens and the engine's log-probabilities of
    each, rewards (N,) and per reward function, advantages (N,)."""

    examples: list[int]
    prompts: list[list[int]]
    completions: list[list[int]]
    logprobs: list[list[float]]
    rewards: Tensor
    by_reward: dict[str, Tensor]
    advantages: Tensor
    scored: dict[int, list[list[float]]] = field(default_factory=dict)  # step -> the engine's scores then

    def __len__(self) -> int:
        return len(self.examples)


class Sampler:
    """The serving engine over the training model, the prompts and the rewards: rollouts, scores and evaluation."""

    def __init__(self, model: DecoderLM, tokenizer: Tokenizer, examples: dict[str, list[Example]], rl: RLConfig):
        self.model, self.tokenizer, self.examples, self.rl = model, tokenizer, examples, rl
        longest = max(len(e.ids) for split in examples.values() for e in split) + rl.max_new_tokens
        if longest > model.max_seq_len:
            raise InputError(f"rl.prompts: a prompt and rl.max_new_tokens={rl.max_new_tokens} make {longest} tokens, "
                             f"beyond the model's {model.max_seq_len}")  # fmt: skip
        was_training = model.training
        config = EngineConfig(kv_memory=rl.kv_memory, max_batch=256, step_tokens=2048, max_queue=1 << 16)
        self.engine = Engine(model, tokenizer, config)  # (it lowers the model in eval mode)
        model.train(was_training)
        names = list(rl.rewards)
        weights = list(rl.reward_weights or [1.0] * len(names))
        self.rewards: list[tuple[str, RewardFn, float]] = [
            (name, resolve_reward(name), w) for name, w in zip(names, weights, strict=True)
        ]
        if rl.reward_model is not None:
            self.rewards.append(("reward_model", RewardModel(rl.reward_model), 1.0))

    def _generate(self, prompts: list[list[int]], params: SamplingParams, fresh: bool = True) -> list[Any]:
        """The engine's completions under the weights as they are now: the prefixes it cached in an earlier call
        may be from before an optimizer step, so they are dropped first (unless not `fresh`: the same weights)."""
        if fresh:
            self.engine.weights_changed()
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                return self.engine.generate(prompts, params)
        finally:
            self.model.train(was_training)

    def rewards_of(self, split: str, examples: list[int], completions: list[Any]) -> dict[str, Tensor]:
        """Each reward function's value for each completion: name -> (N,) float64."""
        seen = [
            Completion(self.examples[split][k].text, c.text, len(c.token_ids), str(c.finish_reason))
            for k, c in zip(examples, completions, strict=True)
        ]
        fields = [self.examples[split][k].fields for k in examples]
        return {
            name: torch.tensor([float(fn(c, f)) for c, f in zip(seen, fields, strict=True)], dtype=torch.float64)
            for name, fn, _ in self.rewards
        }

    def total(self, by_reward: dict[str, Tensor]) -> Tensor:
        return sum((w * by_reward[name] for name, _, w in self.rewards), torch.zeros(()))

    def rollouts(self, indices: list[int], seed: int) -> Rollouts:
        """G sampled completions of each training example in `indices` at rl.temperature (the policy: the logits
        over it), with the log-probabilities of what was sampled from, their rewards and group advantages."""
        G = self.rl.group
        prompts = [self.examples["train"][k].ids for k in indices]
        params = SamplingParams(max_tokens=self.rl.max_new_tokens, temperature=self.rl.temperature, n=G, seed=seed,
                                tempered_logprobs=True)  # fmt: skip
        # each prompt computed once, into the prefix cache, before its G completions (scheduled together, each
        # would compute the prompt itself: G times the prompt's work)
        self._generate(prompts, SamplingParams(max_tokens=0))
        outs = self._generate(prompts, params, fresh=False)
        examples = [k for k in indices for _ in range(G)]
        by_reward = self.rewards_of("train", examples, outs)
        rewards = self.total(by_reward).to(torch.float32)
        advantages = group_advantages(rewards.view(-1, G), self.rl.scale_rewards).flatten()
        return Rollouts(
            examples,
            [self.examples["train"][k].ids for k in examples],
            [list(c.token_ids) for c in outs],
            [list(c.logprobs) for c in outs],
            rewards,
            {k: v.float() for k, v in by_reward.items()},
            advantages,
        )

    def score(self, prompts: list[list[int]], completions: list[list[int]]) -> list[list[float]]:
        """The engine's log-probability of every completion token under the current weights: each text scored as a
        prompt (prompt_logprobs), all together."""
        texts = [p + c for p, c in zip(prompts, completions, strict=True)]
        tempered = SamplingParams(max_tokens=0, prompt_logprobs=0, temperature=self.rl.temperature,
                                  tempered_logprobs=True)  # fmt: skip
        outs = self._generate(texts, tempered)
        scores = []
        for p, out in zip(prompts, outs, strict=True):
            assert out.prompt_logprobs is not None
            scores.append([entry[0] for entry in out.prompt_logprobs[len(p) :] if entry is not None])
        return scores

    def evaluate(self, indices: list[int]) -> dict[str, Tensor]:
        """Greedy completions of held-out examples: the sums of their rewards, total and per function, and their
        count."""
        split = "val" if self.examples["val"] else "train"
        prompts = [self.examples[split][k].ids for k in indices]
        outs = self._generate(prompts, SamplingParams(max_tokens=self.rl.max_new_tokens, temperature=0.0))
        by_reward = self.rewards_of(split, indices, outs)
        sums = {f"reward_{name}": v.sum() for name, v in by_reward.items()}
        return {"reward": self.total(by_reward).sum(), "count": torch.tensor(float(len(indices))), **sums}


def rollout_rows(
    rollouts: Rollouts, rows: list[int], pad_id: int, scored: list[list[float]] | None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(inputs, targets, old log-probabilities, scored log-probabilities) of some of a step's sequences, (n, T) each,
    padded to the longest: inputs are the prompt and completion but the last token, targets the completion's tokens
    where they are predicted (-100 elsewhere), the log-probabilities where the targets are (0 elsewhere); scored
    defaults to the rollout's own (the weights that sampled them)."""
    lengths = [len(rollouts.prompts[i]) + len(rollouts.completions[i]) - 1 for i in rows]
    T = max(lengths)
    inputs = np.full((len(rows), T), pad_id, dtype=np.int64)
    targets = np.full((len(rows), T), -100, dtype=np.int64)
    old = np.zeros((len(rows), T), dtype=np.float32)
    now = np.zeros((len(rows), T), dtype=np.float32)
    for r, i in enumerate(rows):
        prompt, completion = rollouts.prompts[i], rollouts.completions[i]
        ids = prompt + completion
        inputs[r, : len(ids) - 1] = ids[:-1]
        at = len(prompt) - 1
        targets[r, at : at + len(completion)] = completion
        old[r, at : at + len(completion)] = rollouts.logprobs[i]
        now[r, at : at + len(completion)] = scored[i] if scored is not None else rollouts.logprobs[i]
    return tuple(torch.from_numpy(a) for a in (inputs, targets, old, now))  # type: ignore[return-value]


class GRPOModule(nn.Module):
    """The policy and its loss. Training: forward(inputs, targets, old, scored, advantages, reference, stats) -> the
    loss and metrics (stats (3,): the step's mean reward, its spread and mean completion tokens, passed through
    to the log); evaluation: forward(example indices, evaluate=True) -> summed rewards of greedy completions."""

    def __init__(self, model: DecoderLM, sampler: Sampler, rl: RLConfig, reference: DecoderLM | None) -> None:
        super().__init__()
        self.model, self.rl = model, rl
        self._sampler = [sampler]  # a list: not a submodule
        self._reference = [reference] if reference is not None else []

    def forward(self, *batch: Tensor, evaluate: bool = False) -> dict[str, Tensor]:
        if evaluate:
            return self._sampler[0].evaluate(batch[0].tolist())
        inputs, targets, old, scored, advantages, stats = batch
        mask = targets != -100
        with torch.autocast(inputs.device.type, enabled=False):  # fp32: the engine's log-probabilities are
            torch_logps = completion_logps(self.model, inputs, targets, self.rl.temperature)
        logps = scored + (torch_logps - torch_logps.detach())  # the engine's values, PyTorch's gradient
        ref = None
        if self._reference:
            with torch.no_grad():
                ref = completion_logps(self._reference[0], inputs, targets, self.rl.temperature)
        rl = self.rl
        out = policy_loss(logps, old, advantages, mask, clip=rl.clip, clip_high=rl.clip_high, kl_beta=rl.kl_beta,
                          ref_logps=ref, normalise=rl.normalise, max_tokens=rl.max_new_tokens)  # fmt: skip
        gap = ((torch_logps.detach() - scored).abs() * mask).max()
        out.update(reward=stats[0], reward_std=stats[1], completion_tokens=stats[2], logp_gap=gap,
                   advantage=(advantages.abs()).mean())  # fmt: skip
        return out
