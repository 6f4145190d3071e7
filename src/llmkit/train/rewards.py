"""Rewards for reinforcement learning (train/grpo.py): Python functions that score a completion, in a registry.

A reward function takes the finished completion and its example (the prompt's line of the data, every field of
it) and returns a float:

    @reward("exact_answer")
    def exact_answer(completion: Completion, example: dict) -> float: ...

`rl.rewards` names them: a registered name, or "module:function" for a function of your own (imported; it need not
register). Several are summed, each times its weight (`rl.reward_weights`). The built-in ones:

    exact_answer     1 when the completion's answer equals example["answer"], else 0. The answer is what follows
                     the last "####" or "answer:" (any case), else the content of the last \\boxed{...}, else the
                     last number in the text; numbers compare as numbers (1,000 = 1000.0), other answers as
                     stripped strings
    json_schema      1 when the completion is a JSON document valid under example["schema"] (jsonschema), else 0
    format           1 when the stripped completion matches the regular expression example["format"] as a whole
    length_penalty   -(tokens beyond example.get("target_tokens", 64)) / that target: 0 for a short enough answer
    finished         1 when the completion ended by itself (its end token), 0 when it ran out of tokens

A reward model (`rl.reward_model`: a Hugging Face sequence-classification checkpoint, e.g. a Skywork or ArmoRM
reward model) adds its score of the prompt and completion (RewardModel; needs transformers).
"""

from __future__ import annotations

import importlib
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llmkit.errors import ConfigError


@dataclass(frozen=True)
class Completion:
    """What a reward sees of one rollout: the prompt's text, the completion's text (without its end token), its
    token count, and how it ended ("stop": its end token or a stop string; "length": out of tokens)."""

    prompt: str
    text: str
    tokens: int
    finish_reason: str


RewardFn = Callable[[Completion, dict[str, Any]], float]
REWARDS: dict[str, RewardFn] = {}


def reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Register a reward function under `name`."""

    def register(fn: RewardFn) -> RewardFn:
        REWARDS[name] = fn
        return fn

    return register


def resolve_reward(name: str) -> RewardFn:
    """The reward function `name` names: a registered one, or "module:function"."""
    if name in REWARDS:
        return REWARDS[name]
    module, sep, attr = name.partition(":")
    if not sep:
        raise ConfigError(f"rl.rewards: no reward named {name!r} (built in: {', '.join(sorted(REWARDS))}; or give "
                          "module:function)")  # fmt: skip
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"rl.rewards: cannot load {name!r}: {e}") from None
    if not callable(fn):
        raise ConfigError(f"rl.rewards: {name!r} is not a function")
    return fn


NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
MARKED = re.compile(r"(?:####|answer\s*(?:is)?\s*:)\s*(.+)", re.IGNORECASE)
BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def extract_answer(text: str) -> str | None:
    """The answer a completion gives (see exact_answer), or None."""
    marked = MARKED.findall(text)
    if marked:
        answer = marked[-1].strip().splitlines()[0].strip() if marked[-1].strip() else ""
        number = NUMBER.match(answer)
        return number.group(0) if number else answer.rstrip(".")
    boxed = BOXED.findall(text)
    if boxed:
        return boxed[-1].strip()
    numbers = NUMBER.findall(text)
    return numbers[-1] if numbers else None


def same_answer(given: str, expected: object) -> bool:
    """Numbers compare as numbers, anything else as stripped, case-sensitive strings."""
    try:
        a, b = float(given.replace(",", "")), float(str(expected).replace(",", ""))
        return math.isclose(a, b, rel_tol=0.0, abs_tol=1e-9)
    except ValueError:
        return given.strip() == str(expected).strip()


@reward("exact_answer")
def exact_answer(completion: Completion, example: dict[str, Any]) -> float:
    if "answer" not in example:
        raise ConfigError('the exact_answer reward needs an "answer" field in every example')
    given = extract_answer(completion.text)
    return float(given is not None and same_answer(given, example["answer"]))


@reward("json_schema")
def json_schema(completion: Completion, example: dict[str, Any]) -> float:
    try:
        import jsonschema
    except ImportError:
        raise ConfigError("the json_schema reward needs jsonschema: pip install 'llmkit[rl]'") from None
    if "schema" not in example:
        raise ConfigError('the json_schema reward needs a "schema" field in every example')
    try:
        jsonschema.validate(json.loads(completion.text), example["schema"])
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return 0.0
    return 1.0


@reward("format")
def format_(completion: Completion, example: dict[str, Any]) -> float:
    if "format" not in example:
        raise ConfigError('the format reward needs a "format" field (a regular expression) in every example')
    return float(re.fullmatch(example["format"], completion.text.strip(), re.DOTALL) is not None)


@reward("length_penalty")
def length_penalty(completion: Completion, example: dict[str, Any]) -> float:
    target = int(example.get("target_tokens", 64))
    return -max(0, completion.tokens - target) / max(target, 1)


@reward("finished")
def finished(completion: Completion, example: dict[str, Any]) -> float:
    return float(completion.finish_reason == "stop")


class RewardModel:
    """A Hugging Face sequence-classification checkpoint's score of a prompt and its completion (the first logit),
    through transformers: reward models are published in that form. Scored one text at a time, in fp32."""

    def __init__(self, path: str) -> None:
        try:
            import torch
            from transformers import AutoModelForSequenceClassification, AutoTokenizer
        except ImportError:
            raise ConfigError("rl.reward_model needs transformers: pip install 'llmkit[hf]'") from None
        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()

    def __call__(self, completion: Completion, example: dict[str, Any]) -> float:
        ids = self.tokenizer(completion.prompt + completion.text, return_tensors="pt")
        with self.torch.no_grad():
            return float(self.model(**ids).logits[0, 0])
