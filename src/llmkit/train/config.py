"""Training configuration: a YAML file plus command-line overrides (`--set optim.lr=3e-4`).

    model:     a preset and/or ModelConfig fields (nested), e.g. {preset: llama2-7b-tiny, d_model: 256}, or
               {arch: rnn, ...} for the RNN encoder-decoder with attention (RNNConfig fields), or
               {checkpoint: PATH} to start from a checkpoint's weights (an llmkit run or checkpoint, a Hugging Face
               directory, a GGUF file; language models only; with mtp_depth new MTP modules are grafted on, with
               keep_blocks only those blocks are kept: source.py)
    data:      the prepared data folder (a token stream for language models, conversations for chat fine-tuning,
               sentence pairs for translation, a model's own text for its drafter: own_text.py),
               sequence length, micro-batch size per process, or tokens per batch for sentence pairs
    optim:     the optimizer (AdamW, or Muon with AdamW), its settings and gradient clipping
    schedule:  warmup + cosine | warmup-stable-decay | inverse-square-root ("noam") | constant
    train:     steps (the schedule's length), halt_at (stop early, resumable), time_limit, precision,
               accumulation, evaluation, checkpoints, compile, parallelism
    loss:      MTP weight, MoE bias-update rate, sparse-attention indexer warm-up, label smoothing, distillation
               from a teacher checkpoint (a draft model for speculative decoding), a drafter's chain depth and
               feature weight on its model's own text
    lora:      fine-tuning through LoRA adapters (rank, alpha, dropout, target projections; QLoRA on a GGUF file)
    rl:        reinforcement learning with GRPO (train/grpo.py): the prompts, the group size, the rewards, the
               clipping, the KL term and the loss's normalisation
    translate: translation models only: the test-set decoding (beam size, length penalty) after training

Every section is a validated dataclass; unknown keys and bad values are errors that name the key.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml

from llmkit.config import ModelConfig
from llmkit.config.base import ConfigBase
from llmkit.errors import ConfigError
from llmkit.models.rnn import RNNConfig

DEFAULT_PRESET = "llama2-7b-tiny"
Precision = Literal["fp32", "bf16", "fp16", "auto"]
ScheduleKind = Literal["cosine", "wsd", "noam", "constant"]
Parallel = Literal["none", "ddp", "fsdp", "fsdp+tp"]


@dataclass(frozen=True)
class DataConfig(ConfigBase):
    path: ClassVar[str] = "data"
    dir: str = "runs/data/shakespeare"
    seq_len: int = 256  # sentence pairs: the longest sentence kept, per side (longer pairs are left out)
    batch_size: int = 16
    batch_tokens: int = 4096  # sentence pairs: padded tokens per batch and side, per process
    packing: bool = True  # chat examples: several per row (none attending to another), or one per row, padded

    def validate(self) -> None:
        self.at_least(1, "seq_len", "batch_size", "batch_tokens")


@dataclass(frozen=True)
class OptimConfig(ConfigBase):
    """name: adamw, or muon (Muon for the hidden matrices, AdamW for embeddings, head, gains and biases: optim.py);
    lr, weight decay and clipping apply to both; beta1 / beta2 / eps to AdamW; muon_momentum to Muon."""

    path: ClassVar[str] = "optim"
    name: Literal["adamw", "muon"] = "adamw"
    lr: float = 3e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    muon_momentum: float = 0.95

    def validate(self) -> None:
        self.require(self.lr > 0, "lr", "must be > 0")
        self.require(0 <= self.muon_momentum < 1, "muon_momentum", "must be in [0, 1)")
        self.require(0 <= self.beta1 < 1, "beta1", "must be in [0, 1)")
        self.require(0 <= self.beta2 < 1, "beta2", "must be in [0, 1)")
        self.at_least(0, "weight_decay")
        self.require(self.grad_clip >= 0, "grad_clip", "must be >= 0 (0 disables clipping)")


@dataclass(frozen=True)
class ScheduleConfig(ConfigBase):
    """warmup_steps of linear warm-up, then: cosine to min_lr_ratio * lr; wsd: constant, then a linear decay over
    the last decay_fraction of the steps; noam: lr * min(step^-0.5, step * warmup^-1.5) * warmup^0.5 (the paper's
    schedule, peaking at lr); constant."""

    path: ClassVar[str] = "schedule"
    kind: ScheduleKind = "cosine"
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    decay_fraction: float = 0.2

    def validate(self) -> None:
        self.at_least(0, "warmup_steps")
        self.require(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", "must be in [0, 1]")
        self.require(0 < self.decay_fraction <= 1, "decay_fraction", "must be in (0, 1]")
        if self.kind == "noam":
            self.require(self.warmup_steps >= 1, "warmup_steps", "must be >= 1 for the noam schedule")


@dataclass(frozen=True)
class TrainSection(ConfigBase):
    path: ClassVar[str] = "train"
    steps: int = 1000
    halt_at: int | None = None
    time_limit: float | None = None
    fit_to_time: bool = False  # with time_limit: the schedule's length set from the measured step time (and it
    # advances by the time spent when that is ahead of the steps)
    grad_accum: int = 1
    precision: Precision = "fp32"
    compile: bool = False
    activation_checkpointing: bool = False
    parallel: Parallel = "none"
    tp: int = 1  # with parallel fsdp+tp: the model split across this many processes, FSDP over the others
    device: str = "auto"
    seed: int = 1337
    log_every: int = 10
    eval_every: int = 200
    eval_tokens: int = 65536
    save_every: int = 500
    keep_last: int = 3
    average_last: int = 0  # after training, average the weights of the last N checkpoints into OUT/averaged
    out: str = "runs/train"
    progress: bool = True
    trainable: list[str] | None = None  # only parameters under these names train (e.g. [mtp]); None: all

    def validate(self) -> None:
        self.at_least(1, "steps")
        if self.time_limit is not None:
            self.require(self.time_limit > 0, "time_limit", "must be > 0 seconds, or None")
        self.require(
            not self.fit_to_time or self.time_limit is not None,
            "fit_to_time",
            "needs train.time_limit (the budget the schedule is fitted to)",
        )
        if self.halt_at is not None:
            self.require(1 <= self.halt_at <= self.steps, "halt_at", f"must be between 1 and steps={self.steps}")
        self.at_least(1, "grad_accum", "tp")
        if self.tp > 1:
            self.require(self.parallel == "fsdp+tp", "tp", f"needs train.parallel='fsdp+tp', not {self.parallel!r}")
        if self.parallel == "fsdp+tp":
            self.require(self.tp >= 2, "tp", "must be >= 2 with train.parallel='fsdp+tp' (--tp N)")
            self.require(not self.compile, "compile", "is not supported with train.parallel='fsdp+tp' yet")
            self.require(self.trainable is None, "trainable", "is not supported with train.parallel='fsdp+tp'")
        for name in ("log_every", "eval_every", "save_every", "keep_last", "eval_tokens"):
            self.require(getattr(self, name) >= 1, name, "must be >= 1")
        self.require(self.average_last >= 0, "average_last", "must be >= 0 (0: no averaging)")
        if self.trainable is not None:
            ok = isinstance(self.trainable, list) and bool(self.trainable)
            self.require(
                ok and all(isinstance(t, str) and t for t in self.trainable),
                "trainable",
                "must be a non-empty list of parameter-name prefixes, e.g. [mtp], or None",
            )
        if self.average_last:
            self.require(
                self.average_last <= self.keep_last,
                "average_last",
                f"must be <= keep_last={self.keep_last} (only kept checkpoints can be averaged)",
            )


@dataclass(frozen=True)
class LossConfig(ConfigBase):
    path: ClassVar[str] = "loss"
    label_smoothing: float = 0.0
    mtp_weight: float = 0.3
    mtp_target: str = "data"  # data: MTP modules predict the text's tokens; model: the model's own distributions
    moe_bias_update_rate: float = 1e-3
    indexer_warmup_steps: int = 0
    indexer_weight: float = 1.0
    distill_from: str | None = None  # a teacher checkpoint: learn its next-token distributions (a draft model)
    distill_weight: float = 1.0  # the loss is w * KL(teacher || model) * T^2 + (1 - w) * cross-entropy
    distill_temperature: float = 1.0
    unroll: int = 3  # a grafted drafter on its model's own text: the chain depth it trains for (drafting.py)
    feature_weight: float = 1.0  # the same: the weight of its smooth-L1 to the model's next state
    preference: str = "dpo"  # preference pairs: dpo, ipo or simpo (train/preference.py)
    preference_beta: float = 0.1  # DPO's beta (the reward's scale), IPO's tau, SimPO's beta
    preference_gamma: float = 0.5  # SimPO's target margin gamma

    def validate(self) -> None:
        self.require(0 <= self.label_smoothing < 1, "label_smoothing", "must be in [0, 1)")
        self.at_least(0, "mtp_weight", "moe_bias_update_rate", "indexer_warmup_steps", "indexer_weight")
        self.require(self.mtp_target in ("data", "model"), "mtp_target", "must be 'data' or 'model'")
        self.require(0 <= self.distill_weight <= 1, "distill_weight", "must be in [0, 1]")
        self.require(self.distill_temperature > 0, "distill_temperature", "must be > 0")
        self.at_least(1, "unroll")
        self.at_least(0, "feature_weight")
        self.require(self.preference in ("dpo", "ipo", "simpo"), "preference", "must be 'dpo', 'ipo' or 'simpo'")
        self.require(self.preference_beta > 0, "preference_beta", "must be > 0")


@dataclass(frozen=True)
class LoRAConfig(ConfigBase):
    """Fine-tune through LoRA adapters instead of every weight (r > 0; needs model.checkpoint): the checkpoint's
    weights stay frozen, and adapters of rank r with scale alpha / r on the `targets` projections (llmkit's names:
    wq wk wv wo w1 w2 w3, MLA's wq_a wq_b wkv_a wkv_b) are all that trains. Checkpoints hold the adapters only, in
    PEFT's layout. quantized: keep a GGUF checkpoint's quantized weights as the frozen base (QLoRA)."""

    path: ClassVar[str] = "lora"
    r: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    targets: list[str] = field(default_factory=lambda: ["wq", "wk", "wv", "wo"])
    quantized: bool = False

    def validate(self) -> None:
        self.require(self.r >= 0, "r", "must be >= 0 (0: no adapters, every weight trains)")
        self.require(self.alpha > 0, "alpha", "must be > 0")
        self.require(0 <= self.dropout < 1, "dropout", "must be in [0, 1)")
        ok = isinstance(self.targets, list) and bool(self.targets) and all(isinstance(t, str) for t in self.targets)
        self.require(ok, "targets", "must be a non-empty list of projection names, e.g. [wq, wv]")
        self.require(
            not self.quantized or self.r > 0, "quantized", "needs r > 0 (a quantized base trains only adapters)"
        )


@dataclass(frozen=True)
class RLConfig(ConfigBase):
    """GRPO (train/grpo.py), on when `prompts` names a .jsonl file of {"prompt": text or messages, "answer": ...,
    ...} lines: each step samples `group` completions of data.batch_size prompts with the serving engine, scores
    them with `rewards` (train/rewards.py; names or module:function, summed with `reward_weights`) and the
    optional `reward_model`, and takes `iterations` optimizer steps on them with the clipped policy loss."""

    path: ClassVar[str] = "rl"
    prompts: str | None = None
    group: int = 8  # completions per prompt (GRPO's G)
    max_new_tokens: int = 128
    temperature: float = 1.0  # the rollouts' sampling temperature: the policy is the model's logits over it
    rewards: list[str] = field(default_factory=lambda: ["exact_answer"])
    reward_weights: list[float] | None = None  # one per reward (default 1 each)
    reward_model: str | None = None  # a Hugging Face sequence-classification checkpoint, its score added
    clip: float = 0.2  # the ratio's clipping range below 1 (and above, unless clip_high)
    clip_high: float | None = None  # DAPO's clip-higher: a wider range above 1
    kl_beta: float = 0.0  # the KL penalty to the starting model (0: none, and no reference model in memory)
    normalise: Literal["sequence", "token", "constant"] = "sequence"  # GRPO / DAPO / Dr. GRPO
    scale_rewards: bool = True  # divide a group's advantages by its standard deviation (GRPO; Dr. GRPO: false)
    iterations: int = 1  # optimizer steps on each batch of rollouts (GRPO's mu)
    val_fraction: float = 0.1  # prompts held out (by a hash of the line) for evaluation, greedy
    eval_prompts: int = 64  # the most held-out prompts an evaluation answers (all of them at the end of a run)
    kv_memory: int = 1 << 30  # bytes for the engine's paged cache

    def validate(self) -> None:
        self.at_least(1, "group", "max_new_tokens", "iterations", "eval_prompts", "kv_memory")
        self.require(self.group >= 2 or not self.prompts, "group", "must be >= 2 (advantages compare a group)")
        self.require(bool(self.rewards) or self.reward_model is not None, "rewards", "give at least one reward")
        weights_ok = self.reward_weights is None or len(self.reward_weights) == len(self.rewards)
        self.require(weights_ok, "reward_weights", "must give one weight per reward")
        self.require(0 < self.clip < 1, "clip", "must be in (0, 1)")
        self.require(self.clip_high is None or self.clip_high > 0, "clip_high", "must be > 0")
        self.require(self.kl_beta >= 0, "kl_beta", "must be >= 0")
        self.require(0 <= self.val_fraction < 1, "val_fraction", "must be in [0, 1)")
        self.require(self.temperature > 0, "temperature", "must be > 0 (the policy samples)")


@dataclass(frozen=True)
class TranslateConfig(ConfigBase):
    """How a translation run is scored after training: the test split decoded with beam search (the paper's beam
    4, length penalty 0.6), BLEU and chrF by sacreBLEU. test_pairs 0 scores the whole split."""

    path: ClassVar[str] = "translate"
    beams: int = 4
    length_penalty: float = 0.6
    test_pairs: int = 0
    batch_size: int = 32
    score_test: bool = True

    def validate(self) -> None:
        self.at_least(1, "beams")
        self.require(self.test_pairs >= 0, "test_pairs", "must be >= 0 (0: all)")
        self.at_least(1, "batch_size")


@dataclass(frozen=True)
class TrainConfig(ConfigBase):
    model: dict[str, Any] = field(default_factory=lambda: {"preset": DEFAULT_PRESET})
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainSection = field(default_factory=TrainSection)
    loss: LossConfig = field(default_factory=LossConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    translate: TranslateConfig = field(default_factory=TranslateConfig)

    def validate(self) -> None:
        if self.rl.prompts is not None and "checkpoint" not in self.model:
            raise ConfigError("rl.prompts: reinforcement learning starts from a pretrained model: set model.checkpoint")
        if self.rl.prompts is not None and self.train.parallel != "none":
            raise ConfigError("rl.prompts: GRPO runs in one process (its engine shares the model's weights)")
        if self.lora.r and "checkpoint" not in self.model:
            raise ConfigError("lora: adapters fine-tune a pretrained model: set model.checkpoint (lora.r=0 trains all)")
        if self.lora.r and self.train.trainable is not None:
            raise ConfigError("train.trainable: with lora.r > 0 only the adapters train; give one or the other")
        if self.optim.name == "muon" and self.lora.r:
            raise ConfigError("optim.name: muon orthogonalises whole matrices; LoRA's factors train with adamw")
        if self.optim.name == "muon" and self.train.parallel not in ("none", "ddp"):
            raise ConfigError(f"optim.name: muon needs each matrix whole, which train.parallel={self.train.parallel} "
                              "splits across processes; use none or ddp, or optim.name=adamw")  # fmt: skip

    def to_yaml(self, path: str | os.PathLike[str] | None = None) -> str:
        text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        if path is not None:
            Path(path).write_text(text)
        return text

    def model_config(self, vocab_size: int | None = None, src_vocab_size: int | None = None) -> ModelConfig | RNNConfig:
        """The model config: the preset's, with the other `model` keys merged in (nested); vocab_size defaults to the
        data's (src_vocab_size: the source side's, for separate translation vocabularies), and max_seq_len grows to
        the training sequence length. `arch: rnn` gives an RNNConfig."""
        from llmkit.config.presets import get_preset

        spec = copy.deepcopy(self.model)
        if "checkpoint" in spec:
            raise ConfigError(
                "model.checkpoint: starting from a checkpoint is for language models on a token stream (decoder-only); "
                "use model.preset or model fields here"
            )
        if spec.get("arch") == "rnn":
            if vocab_size is not None:
                spec.setdefault("vocab_size", vocab_size)
            if src_vocab_size is not None:
                spec.setdefault("src_vocab_size", src_vocab_size)
            spec["max_seq_len"] = max(int(spec.get("max_seq_len", 0) or 0), self.data.seq_len + 2)
            try:
                return RNNConfig.from_dict(spec)
            except ConfigError as e:
                raise ConfigError(f"model: {e}") from None
        preset = spec.pop("preset", None)
        if preset is None and not {"d_model", "n_layers"} <= set(spec):
            raise ConfigError("model: give a preset (e.g. preset: llama2-7b-tiny) or at least d_model and n_layers")
        base = get_preset(preset).to_dict() if preset else {}
        merged = _merge(base, spec)
        if vocab_size is not None and "vocab_size" not in spec:
            merged["vocab_size"] = vocab_size
        separate = src_vocab_size is not None and not (spec.get("encoder") or {}).get("vocab_size")
        if separate and isinstance(merged.get("encoder"), dict):  # separate vocabularies: a source embedding
            merged["encoder"]["vocab_size"] = src_vocab_size
        position = merged.setdefault("position", {})
        extra = 2 if isinstance(merged.get("encoder"), dict) else 0  # the start token and </s> of a target
        position["max_seq_len"] = max(int(position.get("max_seq_len", 0) or 0), self.data.seq_len + extra)
        try:
            return ModelConfig.from_dict(merged)
        except ConfigError as e:
            raise ConfigError(f"model: {e}") from None


def pretrained_config(spec: dict[str, Any], base: ModelConfig, seq_len: int) -> ModelConfig:
    """The config of a run that starts from a checkpoint whose config is `base`: the other `model` keys of `spec`
    (next to `checkpoint`) may change the training-only settings (dropout, MoE loss coefficients), never what the
    weights compute, except mtp_depth on a checkpoint that has no MTP modules: new ones are grafted onto it. The
    checkpoint's context must hold the training sequences."""
    over = {k: v for k, v in spec.items() if k != "checkpoint"}
    if "preset" in over:
        raise ConfigError("model: give either checkpoint (start from its weights) or preset, not both")
    try:
        cfg = ModelConfig.from_dict(_merge(base.to_dict(), over))
    except ConfigError as e:
        raise ConfigError(f"model: {e}") from None
    grafted = cfg.mtp_depth > base.mtp_depth == 0  # new MTP modules on a checkpoint that has none
    if dataclasses.replace(cfg, mtp_depth=base.mtp_depth).architecture() != base.architecture() or (
        cfg.mtp_depth != base.mtp_depth and not grafted
    ):
        changed = sorted(k for k in over if _merge(base.to_dict(), {k: over[k]}) != base.to_dict())
        raise ConfigError(
            f"model: {', '.join(changed)} would change the architecture of the checkpoint {spec['checkpoint']}; "
            "next to model.checkpoint only training settings (dropout, loss coefficients) can be set, and mtp_depth "
            "on a checkpoint without MTP modules (grafting new ones)"
        )
    if seq_len > cfg.position.max_seq_len:
        raise ConfigError(
            f"data.seq_len={seq_len} is longer than the checkpoint's context ({cfg.position.max_seq_len} tokens): "
            f"set data.seq_len <= {cfg.position.max_seq_len}"
        )
    return cfg


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def apply_override(data: dict[str, Any], assignment: str) -> None:
    """Apply 'a.b.c=value' to a nested dict; the value is parsed as YAML (numbers, booleans, lists, null)."""
    if "=" not in assignment:
        raise ConfigError(f"--set {assignment!r}: expected KEY=VALUE, e.g. optim.lr=3e-4")
    key, raw = assignment.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"--set {assignment!r}: empty key part")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {assignment!r}: cannot parse the value: {e}") from None
    node = data
    for p in parts[:-1]:
        child = node.get(p)
        if child is None:
            child = node[p] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"--set {assignment!r}: {p!r} is not a section")
        node = child
    node[parts[-1]] = value


def load_train_config(path: str | os.PathLike[str] | None, overrides: list[str] | None = None) -> TrainConfig:
    """A TrainConfig from a YAML file (or the defaults) with `--set` overrides applied."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"training config {str(p)!r} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text(encoding="utf-8"))
        except yaml.YAMLError as e:
            raise ConfigError(f"{p} is not valid YAML: {e}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{p} is not a YAML text file: byte {e.start} is not UTF-8 ({e.reason})") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{p} must hold a mapping of sections (model, data, optim, ...)")
        data = loaded or {}
    default = "model" not in data
    data.setdefault("model", {"preset": DEFAULT_PRESET})  # so that --set model.x=... refines the default model
    for assignment in overrides or []:
        apply_override(data, assignment)
    if default and isinstance(data["model"], dict) and "checkpoint" in data["model"]:
        data["model"].pop("preset", None)  # --set model.checkpoint=PATH: the checkpoint is the model
    # YAML numbers such as 3e-4 parse as strings in YAML 1.1: accept them for float fields
    for section in ("optim", "schedule", "train", "loss", "lora", "translate"):
        for k, v in list((data.get(section) or {}).items()):
            if isinstance(v, str):
                with contextlib.suppress(ValueError):
                    data[section][k] = float(v) if any(c in v for c in ".eE") else int(v)
    if "model" in data and not isinstance(data["model"], dict):
        raise ConfigError("model: must be a mapping, e.g. {preset: llama2-7b-tiny}")
    return TrainConfig.from_dict(data)
