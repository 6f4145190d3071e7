"""Training tasks: what a batch is, which models can learn it and what loss it gives. The loop is the same for every
task; where the model comes from is source.py's, what of it trains strategy.py's.

    LanguageModelTask   next-token prediction on a token stream (decoder-only models), with every extra term the
                        architecture needs (MoE balance and z losses, the MTP loss, the sparse-attention indexer's
                        loss) and the hooks its training needs (router bias updates, the indexer's warm-up); with
                        loss.distill_from, a live teacher's distributions (distill.py)
    ChatTask            the same on conversations: only the assistant's tokens count, examples packed
    TranslationTask     sentence pairs (encoder-decoder models: the Transformer or the RNN), batched by token
                        count from length buckets; teacher forcing behind the start token <s>
    OwnTextTask         a model's own text (own_text.py): its drafter learns the model's recorded top-k
                        distributions (drafting.py)
    PreferenceTask      pairs of answers, one preferred (data/preferences.py): DPO, IPO or SimPO (preference.py)
                        against the reference log-probabilities prepared with the data
    GRPOTask            prompts with checkable answers (rl.prompts): GRPO (grpo.py), completions sampled by the
                        serving engine on the model being trained, scored by reward functions (rewards.py)

A task builds the module the loop calls: its forward returns a dict of scalars, "loss" (to backpropagate) and the
task's `terms` (to log), plus statistics its hooks read (summed over micro-steps); with evaluate=True it returns the
summed evaluation loss "nll" and the token "count" (a task's `eval_terms`, summed over batches and processes, which
its `summarize` turns into the logged metrics). Wrapping the model in one module keeps DDP and FSDP to one
forward call per micro-batch. `build_task` picks the task from the data folder.
"""

from __future__ import annotations

import abc
import copy
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from llmkit.analysis import analyze
from llmkit.config import ModelConfig
from llmkit.data.bitexts import ParallelData, is_parallel
from llmkit.data.chat import ChatData, ChatSplit, is_chat, pack, row_arrays
from llmkit.data.preferences import PreferenceData, fingerprint, is_preferences
from llmkit.layers.attention import DeepSeekSparseAttention
from llmkit.layers.extras import Extras, IndexerMode
from llmkit.models import DecoderLM, EncoderDecoder, RNNConfig, RNNSeq2Seq
from llmkit.models.loss import cross_entropy, moe_loss
from llmkit.tokenizer import Tokenizer
from llmkit.train.buckets import BucketedPairs
from llmkit.train.config import TrainConfig
from llmkit.train.data import TokenData, eval_offsets, train_batch, window_batch
from llmkit.train.distill import distillation_kl
from llmkit.train.drafting import TERMS as DRAFTING_TERMS
from llmkit.train.drafting import DraftDistilling, MTPDrafting
from llmkit.train.grpo import TERMS as GRPO_TERMS
from llmkit.train.grpo import GRPOModule, Rollouts, Sampler, read_prompts, rollout_rows
from llmkit.train.hooks import Hook, IndexerWarmUp, RouterBiasUpdate, router_bias_layers
from llmkit.train.metrics import bits_per_char
from llmkit.train.own_text import META as OWN_TEXT_META
from llmkit.train.own_text import is_own_text, read_meta, read_own_text
from llmkit.train.parallel import Runtime
from llmkit.train.preference import Pairs, PreferenceLoss, answer_logps, preference_loss
from llmkit.train.source import Model, TrainingError, load_teacher

TERMS = ("loss", "ce", "aux", "mtp", "indexer")


class Task(abc.ABC):
    """What the loop needs of a task; the subclasses fill it in."""

    terms: tuple[str, ...] = TERMS  # the loss terms the training module returns and the loop logs
    tokenizer: Tokenizer | None
    source_tokenizer: Tokenizer | None = None  # a translation model's, with separate vocabularies
    generation_config: dict[str, Any]  # what a checkpoint tells decoders (start and end tokens)

    def __init__(self, cfg: TrainConfig, rt: Runtime) -> None:
        self.cfg, self.rt = cfg, rt
        self.generation_config = {}

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """The data's vocabulary size (the model's must be at least this)."""

    @property
    def vocab_sizes(self) -> dict[str, int | None]:
        """The vocabulary sizes a new model's config takes from the data (model_config's keyword arguments)."""
        return {"vocab_size": self.vocab_size}

    @abc.abstractmethod
    def check_model(self, config: ModelConfig | RNNConfig) -> None:
        """A TrainingError when a model of `config` cannot learn this task's data."""

    @property
    @abc.abstractmethod
    def chars_per_token(self) -> float:
        """Characters per token of the evaluation split (for bits per character)."""

    @abc.abstractmethod
    def attach(self, model: Model) -> nn.Module:
        """The module the loop calls: forward(*batch, **hook options) -> loss terms (see the module docstring)."""

    def hooks(self, model: Model) -> list[Hook]:
        """The training strategies this model needs."""
        return []

    def forward_flops_per_token(self, config: ModelConfig | RNNConfig) -> float | None:
        """The forward pass's FLOPs per training token (for MFU), or None when not counted."""
        return None

    @abc.abstractmethod
    def batch(self, step: int, micro: int) -> tuple[tuple[Tensor, ...], int]:
        """This process's batch for (step, micro-step), and the tokens it holds."""

    def micro_batch(self) -> tuple[int, str, int, int]:
        """The most tokens of one micro-batch, the setting that sizes it, its value and the tokens a unit of it
        holds (for the memory check before training: train/memory.py): batch_size rows of seq_len tokens."""
        d = self.cfg.data
        return d.batch_size * d.seq_len, "data.batch_size", d.batch_size, d.seq_len

    @abc.abstractmethod
    def eval_batches(self, full: bool) -> Iterator[tuple[Tensor, ...]]:
        """The evaluation batches of this process (all of the split when `full`)."""

    eval_terms: tuple[str, ...] = ("nll", "count")  # what the module returns with evaluate=True, summed

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        """The evaluation's metrics from the sums of eval_terms: loss per token, perplexity, bits per character."""
        loss = sums["nll"] / sums["count"]
        return {
            "val_loss": loss,
            "val_ppl": math.exp(min(loss, 50.0)),
            "val_bpc": bits_per_char(loss, self.chars_per_token),
        }


class EpochOrder:
    """A fresh shuffled order of n items every epoch, a function of (seed, epoch) alone (resume stays exact); the
    last epoch asked for is kept."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed = n, seed
        self._last: tuple[int, np.ndarray] | None = None

    def __call__(self, epoch: int) -> np.ndarray:
        if self._last is None or self._last[0] != epoch:
            self._last = epoch, np.random.default_rng([self.seed, epoch]).permutation(self.n)
        return self._last[1]


def build_task(cfg: TrainConfig, rt: Runtime) -> Task:
    """The task the data folder calls for: sentence pairs train a translation model, a token stream or
    conversations a language model, preference pairs a language model's preferences, a model's own text its
    drafter; with rl.prompts, GRPO on those prompts."""
    if cfg.rl.prompts is not None:
        return GRPOTask(cfg, rt)
    if is_parallel(cfg.data.dir):
        return TranslationTask(cfg, rt)
    if is_own_text(cfg.data.dir):
        return OwnTextTask(cfg, rt)
    if is_preferences(cfg.data.dir):
        return PreferenceTask(cfg, rt)
    return ChatTask(cfg, rt) if is_chat(cfg.data.dir) else LanguageModelTask(cfg, rt)


class LanguageModule(nn.Module):
    """A decoder-only model and its loss settings; forward(inputs, targets) -> the loss terms and statistics."""

    def __init__(self, model: DecoderLM, cfg: TrainConfig, teacher: DecoderLM | None = None) -> None:
        super().__init__()
        self.model, self.cfg = model, cfg
        self.bias_layers = router_bias_layers(model)
        self._teacher = [teacher] if teacher is not None else []  # a list: not a submodule (frozen, never saved)

    def forward(
        self,
        inputs: Tensor,
        targets: Tensor,
        segments: Tensor | None = None,
        evaluate: bool = False,
        indexer: IndexerMode = "off",
    ) -> dict[str, Tensor]:
        """segments (B, T): packed examples (chat fine-tuning), none attending to another; targets -100 do not
        count."""
        if evaluate:  # summed next-token loss and the token count (through the wrapper, so FSDP gathers weights)
            logits = self.model(inputs, segments=segments)
            flat = targets.flatten()
            nll = nn.functional.cross_entropy(logits.flatten(0, 1).float(), flat, reduction="sum", ignore_index=-100)
            return {"nll": nll, "count": (flat != -100).sum().to(nll.dtype)}
        c = self.cfg.loss
        extras = Extras(indexer=indexer)
        if self._teacher:
            return self._distill(inputs, targets, segments, extras)
        out = self.model.loss(
            targets,
            inputs=inputs,
            label_smoothing=c.label_smoothing,
            mtp_weight=c.mtp_weight,
            extras=extras,
            segments=segments,
            mtp_target=c.mtp_target,
        )
        indexer_loss = extras.indexer_loss(out.ce)
        total = out.total + c.indexer_weight * indexer_loss
        if indexer == "dense":  # the indexer's warm-up: the rest of the model gets zero gradients (and lr 0)
            total = out.total * 0.0 + c.indexer_weight * indexer_loss
        result = {"loss": total, "ce": out.ce, "aux": out.aux, "mtp": out.mtp, "indexer": indexer_loss}
        if self.bias_layers:
            load = extras.expert_load()
            none = out.ce.new_zeros(self.model.cfg.moe.n_experts if self.model.cfg.moe else 0)
            result["expert_load"] = torch.stack([load.get(i, none) for i in self.bias_layers])  # (L, E)
        return result

    def _distill(self, inputs: Tensor, targets: Tensor, segments: Tensor | None, extras: Extras) -> dict[str, Tensor]:
        """The distillation loss (llmkit.train.distill): the teacher's distributions mixed with the data's tokens. The
        terms are the usual ones (ce: the data's cross-entropy) plus kl."""
        c = self.cfg.loss
        with torch.no_grad():
            teacher = self._teacher[0](inputs, segments=segments)  # (B, T, V)
        logits = self.model(inputs, segments=segments, extras=extras)  # (B, T, V)
        ce = cross_entropy(logits, targets, -100, c.label_smoothing)
        kl = distillation_kl(logits, teacher, targets, c.distill_temperature)
        aux = moe_loss(extras, self.model.cfg.moe, ce)
        total = c.distill_weight * kl + (1 - c.distill_weight) * ce + aux
        zero = ce.new_zeros(())
        return {"loss": total, "ce": ce, "aux": aux, "mtp": zero, "indexer": zero, "kl": kl}


class LanguageModelTask(Task):
    """Random windows of the training stream; inputs and targets shifted by one token."""

    def __init__(self, cfg: TrainConfig, rt: Runtime) -> None:
        super().__init__(cfg, rt)
        if cfg.loss.distill_from is not None:
            self.terms = (*TERMS, "kl")
        self.load_data(cfg)
        self.tokenizer = Tokenizer.from_dir(cfg.data.dir)

    def check_model(self, config: ModelConfig | RNNConfig) -> None:
        if not isinstance(config, ModelConfig) or config.is_encoder_decoder:
            raise TrainingError(
                f"{self.cfg.data.dir} holds a token stream: language-model training needs a decoder-only model (this "
                "config has an encoder; encoder-decoder models train on sentence pairs)"
            )

    def load_data(self, cfg: TrainConfig) -> None:
        self.data = TokenData(cfg.data.dir)
        self.data.check_window(cfg.data.seq_len)

    @property
    def vocab_size(self) -> int:
        return self.data.vocab_size

    def attach(self, model: Model) -> nn.Module:
        assert isinstance(model, DecoderLM)
        teacher = None
        if self.cfg.loss.distill_from is not None:  # a draft model learning its target's distributions
            teacher = load_teacher(self.cfg.loss.distill_from, model, self.rt.device)
        return LanguageModule(model, self.cfg, teacher)

    def hooks(self, model: Model) -> list[Hook]:
        hooks: list[Hook] = []
        if router_bias_layers(model) and self.cfg.loss.moe_bias_update_rate:
            hooks.append(RouterBiasUpdate(model, self.cfg.loss.moe_bias_update_rate))
        if any(isinstance(m, DeepSeekSparseAttention) for m in model.modules()):
            hooks.append(IndexerWarmUp(self.cfg.loss.indexer_warmup_steps))
        return hooks

    def forward_flops_per_token(self, config: ModelConfig | RNNConfig) -> float | None:
        assert isinstance(config, ModelConfig)
        return analyze(config, seq_len=self.cfg.data.seq_len).flops_per_token

    def batch(self, step: int, micro: int) -> tuple[tuple[Tensor, ...], int]:
        """(inputs, targets) of this process for (step, micro-step), and how many tokens they hold."""
        d = self.cfg.data
        x, y = train_batch(
            self.data, d.seq_len, d.batch_size, self.cfg.train.seed, step, micro, self.rt.rank, self.rt.world
        )
        tensors = (x.to(self.rt.device, non_blocking=True), y.to(self.rt.device, non_blocking=True))
        return tensors, d.batch_size * d.seq_len

    @property
    def eval_split(self) -> str:
        return "val" if "val" in self.data.splits else "train"

    def eval_batches(self, full: bool) -> Iterator[tuple[Tensor, ...]]:
        """Evenly spaced windows of the validation split (all of it when `full`), this process's share."""
        split = self.data.split(self.eval_split)
        T, B = self.cfg.data.seq_len, self.cfg.data.batch_size
        budget = len(split.tokens) if full else self.cfg.train.eval_tokens
        offsets = eval_offsets(len(split.tokens), T, budget)[self.rt.rank :: self.rt.world]
        for i in range(0, len(offsets), B):
            x, y = window_batch(split.tokens, offsets[i : i + B], T)
            yield x.to(self.rt.device), y.to(self.rt.device)

    @property
    def chars_per_token(self) -> float:
        return self.data.split(self.eval_split).chars_per_token


class ChatTask(LanguageModelTask):
    """Supervised fine-tuning on conversations (llmkit.data.chat): the loss counts only the assistant's tokens, and
    rows pack whole examples that never attend to one another (data.packing), or hold one example each, padded to
    the longest of the batch. Rows come in a shuffled order that changes every epoch, as a function of the step."""

    def load_data(self, cfg: TrainConfig) -> None:
        self.data = ChatData(cfg.data.dir)  # type: ignore[assignment]
        self.chat: ChatData = self.data  # type: ignore[assignment]
        self._rows: list[list[int]] = []
        self._epochs = 0

    def _row(self, k: int) -> list[int]:
        """Row k of the training stream: epoch after epoch, each a fresh permutation of the examples, packed."""
        split = self.chat.split("train")
        while len(self._rows) <= k:
            order = np.random.default_rng([self.cfg.train.seed, self._epochs]).permutation(len(split))
            self._rows += pack(split.lengths(), order, self.cfg.data.seq_len, self.cfg.data.packing)
            self._epochs += 1
        return self._rows[k]

    def _tensors(self, split: ChatSplit, rows: list[list[int]]) -> tuple[tuple[Tensor, ...], int]:
        T = self.cfg.data.seq_len
        width = T
        if not self.cfg.data.packing:  # padded to the longest example of the batch
            width = max(min(int(split.lengths()[row[0]]) - 1, T) for row in rows)
        x, y, seg = row_arrays(split, rows, T, self.chat.pad_id, width)
        tensors = tuple(torch.from_numpy(a).to(self.rt.device, non_blocking=True) for a in (x, y, seg))
        return tensors, int((seg >= 0).sum())

    def batch(self, step: int, micro: int) -> tuple[tuple[Tensor, ...], int]:
        """(inputs, targets, segments) of this process for (step, micro-step), and the example tokens they hold."""
        B = self.cfg.data.batch_size
        first = ((step * self.cfg.train.grad_accum + micro) * self.rt.world + self.rt.rank) * B
        return self._tensors(self.chat.split("train"), [self._row(first + i) for i in range(B)])

    @property
    def eval_split(self) -> str:
        return "val" if len(self.chat.splits.get("val", ())) else "train"

    def eval_batches(self, full: bool) -> Iterator[tuple[Tensor, ...]]:
        """The validation examples in order, packed (all of them when `full`, else about train.eval_tokens)."""
        split = self.chat.split(self.eval_split)
        rows = pack(split.lengths(), np.arange(len(split)), self.cfg.data.seq_len, self.cfg.data.packing)
        if not full:
            per_row = max(1, int(split.offsets[-1]) // max(len(rows), 1))
            rows = rows[: max(1, self.cfg.train.eval_tokens // per_row)]
        rows = rows[self.rt.rank :: self.rt.world]
        B = self.cfg.data.batch_size
        for i in range(0, len(rows), B):
            yield self._tensors(split, rows[i : i + B])[0]

    @property
    def chars_per_token(self) -> float:
        """Characters per target token of the evaluation split (bits per character of the assistant's text)."""
        info = self.chat.meta["splits"][self.eval_split]
        return info["target_chars"] / max(info["target_tokens"], 1)


class TranslationModule(nn.Module):
    """An encoder-decoder and its loss settings; forward(source, source_mask, target, target_mask) -> the loss terms,
    or with evaluate=True the summed target-token NLL and the token count."""

    def __init__(self, model: EncoderDecoder | RNNSeq2Seq, cfg: TrainConfig, start_id: int) -> None:
        super().__init__()
        self.model, self.cfg, self.start_id = model, cfg, start_id

    def forward(
        self, source: Tensor, source_mask: Tensor, target: Tensor, target_mask: Tensor, evaluate: bool = False
    ) -> dict[str, Tensor]:
        smoothing = 0.0 if evaluate else self.cfg.loss.label_smoothing
        out = self.model.loss(
            source,
            target,
            start_id=self.start_id,
            source_mask=source_mask,
            target_mask=target_mask,
            label_smoothing=smoothing,
        )
        if evaluate:
            count = torch.tensor(float(out.n_tokens), device=out.ce.device)
            return {"nll": out.ce.float() * count, "count": count}
        zero = out.ce.new_zeros(())
        return {"loss": out.total, "ce": out.ce, "aux": out.aux, "mtp": out.mtp, "indexer": zero}


class TranslationTask(Task):
    """Sentence pairs batched by token count (see buckets.py); validation in fixed length-sorted batches."""

    def __init__(self, cfg: TrainConfig, rt: Runtime) -> None:
        super().__init__(cfg, rt)
        self.data = data = ParallelData(cfg.data.dir)
        self.source_tokenizer, self.tokenizer = data.tokenizers()
        self.generation_config = {
            "decoder_start_token_id": data.bos_id,
            "eos_token_id": data.eos_id,
            "pad_token_id": data.pad_id,
            "bad_words_ids": [[data.pad_id], [data.bos_id]],
        }
        d = cfg.data
        self.train = BucketedPairs(
            data.side("train", "src"), data.side("train", "tgt"), d.batch_tokens, d.seq_len, cfg.train.seed, data.pad_id
        )
        self.eval_split = "val" if len(data.side("val", "src")) else "train"
        src, tgt = data.side(self.eval_split, "src"), data.side(self.eval_split, "tgt")
        self.val = BucketedPairs(src, tgt, d.batch_tokens, d.seq_len, 0, data.pad_id)

    @property
    def vocab_size(self) -> int:
        return self.data.vocab_size

    @property
    def vocab_sizes(self) -> dict[str, int | None]:
        d = self.data
        return {"vocab_size": d.vocab_size, "src_vocab_size": None if d.shared_vocab else d.src_vocab_size}

    def check_model(self, config: ModelConfig | RNNConfig) -> None:
        if not config.is_encoder_decoder:
            raise TrainingError(
                f"{self.cfg.data.dir} holds sentence pairs: translation needs an encoder-decoder model (e.g. "
                "model.preset=transformer-base, or model.arch=rnn), not a decoder-only one"
            )

    def attach(self, model: Model) -> nn.Module:
        assert isinstance(model, (EncoderDecoder, RNNSeq2Seq))
        return TranslationModule(model, self.cfg, self.data.bos_id)

    def micro_batch(self) -> tuple[int, str, int, int]:
        """batch_tokens padded tokens a side: source and target."""
        d = self.cfg.data
        return 2 * d.batch_tokens, "data.batch_tokens", d.batch_tokens, 2

    def batch(self, step: int, micro: int) -> tuple[tuple[Tensor, ...], int]:
        """This process's batch for (step, micro-step), and its real tokens (source + target)."""
        g = (step * self.cfg.train.grad_accum + micro) * self.rt.world + self.rt.rank
        b = self.train.batch(g).to(self.rt.device)
        return (b.source, b.source_mask, b.target, b.target_mask), b.tokens

    def eval_batches(self, full: bool) -> Iterator[tuple[Tensor, ...]]:
        """The validation pairs in length-sorted batches (a spread-out subset of about train.eval_tokens target
        tokens unless `full`), this process's share."""
        batches = self.val.batches  # shortest to longest
        if not full:
            total = int(self.val.tgt.lengths[np.concatenate(batches)].sum())
            if total > self.cfg.train.eval_tokens:
                keep = max(1, round(len(batches) * self.cfg.train.eval_tokens / total))
                batches = [batches[int(i)] for i in np.linspace(0, len(batches) - 1, keep).astype(np.int64)]
        for rows in batches[self.rt.rank :: self.rt.world]:
            b = self.val.make(rows).to(self.rt.device)
            yield b.source, b.source_mask, b.target, b.target_mask

    @property
    def chars_per_token(self) -> float:
        return self.data.chars_per_token(self.eval_split)


class OwnTextTask(Task):
    """A drafter learning its model's own text (own_text.py, drafting.py): rows of the train split in a shuffled
    order that changes every epoch, as a function of the step; the held-out split for evaluation. A model with MTP
    modules trains them as drafters (MTPDrafting), one without is a draft model (DraftDistilling)."""

    terms = DRAFTING_TERMS

    def __init__(self, cfg: TrainConfig, rt: Runtime) -> None:
        super().__init__(cfg, rt)
        d = cfg.data.dir
        self.meta = read_meta(d, "train")
        self.text = read_own_text(d, "train")
        self.held_split = "val" if (Path(d) / "val" / OWN_TEXT_META).is_file() else "train"
        self.held = self.text if self.held_split == "train" else read_own_text(d, "val")
        self.tokenizer = Tokenizer.from_dir(Path(d) / "train")
        self._order: tuple[int, Tensor] | None = None  # (epoch, its permutation of the rows)
        if len(self.text) < cfg.data.batch_size:
            raise TrainingError(
                f"{d} holds {len(self.text)} sequences, fewer than data.batch_size={cfg.data.batch_size}"
            )

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    def check_model(self, config: ModelConfig | RNNConfig) -> None:
        if not isinstance(config, ModelConfig) or config.is_encoder_decoder:
            raise TrainingError(f"{self.cfg.data.dir} holds a model's own text: it trains decoder-only drafters")
        if config.d_model != self.meta["width"]:
            raise TrainingError(
                f"{self.cfg.data.dir} holds the states of a model {self.meta['width']} wide; this one is "
                f"{config.d_model}: start from the model whose text it is (model.checkpoint)"
            )

    def attach(self, model: Model) -> nn.Module:
        assert isinstance(model, DecoderLM)
        if len(model.mtp):
            return MTPDrafting(model, self.cfg.loss.unroll, self.cfg.loss.feature_weight)
        return DraftDistilling(model)

    def micro_batch(self) -> tuple[int, str, int, int]:
        T = int(self.meta["tokens_per_sequence"])
        B = self.cfg.data.batch_size
        return B * T, "data.batch_size", B, T

    def batch(self, step: int, micro: int) -> tuple[tuple[Tensor, ...], int]:
        """(tokens, hidden, top_logits, top_ids) of this process for (step, micro-step), and the tokens they hold."""
        B = self.cfg.data.batch_size
        g = (step * self.cfg.train.grad_accum + micro) * self.rt.world + self.rt.rank
        epoch, k = divmod(g, len(self.text) // B)
        if self._order is None or self._order[0] != epoch:
            generator = torch.Generator().manual_seed(self.cfg.train.seed * 1_000_003 + epoch)
            self._order = epoch, torch.randperm(len(self.text), generator=generator)
        rows = self.text.rows(self._order[1][k * B : (k + 1) * B])
        return rows.tensors(self.rt.device), rows.tokens.numel()

    def eval_batches(self, full: bool) -> Iterator[tuple[Tensor, ...]]:
        """Every held-out sequence (a few dozen), this process's share."""
        index = torch.arange(len(self.held))[self.rt.rank :: self.rt.world]
        B = self.cfg.data.batch_size
        for i in range(0, len(index), B):
            yield self.held.rows(index[i : i + B]).tensors(self.rt.device)

    @property
    def chars_per_token(self) -> float:
        return float(read_meta(self.cfg.data.dir, self.held_split)["chars_per_token"])


PREFERENCE_TERMS = ("loss", "reward_margin", "reward_accuracy", "reward_chosen", "reward_rejected")


class PreferenceModule(nn.Module):
    """A decoder-only model learning preferences; forward(inputs, targets, reference) -> the preference loss and its
    metrics (train/preference.py). Rows alternate: 2k holds pair k's chosen answer, 2k + 1 its rejected one; targets
    are the answer's tokens (-100 elsewhere); reference (pairs, 2) the reference model's summed log-probabilities of
    them (empty for SimPO). With evaluate=True: the loss and metrics summed over the pairs, and their count."""

    def __init__(self, model: DecoderLM, kind: PreferenceLoss, beta: float, gamma: float) -> None:
        super().__init__()
        self.model, self.kind, self.beta, self.gamma = model, kind, beta, gamma

    def forward(self, inputs: Tensor, targets: Tensor, reference: Tensor, evaluate: bool = False) -> dict[str, Tensor]:
        logps, counts = answer_logps(self.model(inputs), targets)
        policy = Pairs(logps[0::2], logps[1::2], counts[0::2], counts[1::2])
        ref = None
        if reference.numel():
            ref = Pairs(reference[:, 0], reference[:, 1], policy.chosen_tokens, policy.rejected_tokens)
        out = preference_loss(self.kind, policy, ref, self.beta, self.gamma)
        if not evaluate:
            return out
        pairs = logps.new_tensor(float(len(policy.chosen)))
        return {"loss": out["loss"] * pairs, "reward_accuracy": out["reward_accuracy"] * pairs,
                "reward_margin": out["reward_margin"] * pairs, "pairs": pairs}  # fmt: skip


class PreferenceTask(ChatTask):
    """Preference optimisation on prepared pairs (llmkit.data.preferences): data.batch_size pairs a micro-batch, in
    a shuffled order that changes every epoch, as a function of the step; each sequence in its own row, padded to
    the longest of the batch (never cut: the reference scored it whole). DPO and IPO need the reference the data was
    prepared with, so the run must start from that checkpoint; SimPO needs none."""

    terms = PREFERENCE_TERMS
    eval_terms = ("loss", "reward_accuracy", "reward_margin", "pairs")

    def load_data(self, cfg: TrainConfig) -> None:
        self.data = self.pairs = PreferenceData(cfg.data.dir)  # type: ignore[assignment]
        self.chat = self.pairs
        self._order = EpochOrder(len(self.pairs.split("train")) // 2, cfg.train.seed)
        info = self.pairs.meta["splits"]
        longest = max(v["longest"] for v in info.values())
        if longest - 1 > cfg.data.seq_len:
            raise TrainingError(
                f"{cfg.data.dir} holds sequences of up to {longest} tokens: set data.seq_len to at least {longest - 1} "
                "(pairs are never cut: the reference scored them whole), or prepare with a lower --max-tokens"
            )
        self.kind: PreferenceLoss = cfg.loss.preference  # type: ignore[assignment]
        if self.kind != "simpo":
            self.check_reference(cfg)

    def check_reference(self, cfg: TrainConfig) -> None:
        """DPO and IPO compare the policy with the model the data's reference log-probabilities came from: the run
        must start from that very checkpoint (its files' fingerprint), loaded the same way (quantized or not)."""
        from llmkit.runs import resolve_checkpoint

        ref = self.pairs.meta.get("reference")
        if ref is None:
            raise TrainingError(
                f"loss.preference={self.kind} needs the reference model's log-probabilities: prepare {cfg.data.dir} "
                "with them (llmkit prepare preferences FILE --checkpoint CK), or use loss.preference=simpo"
            )
        checkpoint = cfg.model.get("checkpoint")
        if checkpoint is None:
            raise TrainingError(
                f"loss.preference={self.kind} fine-tunes the model the reference was computed with: set "
                f"model.checkpoint={ref['checkpoint']}"
            )
        path = resolve_checkpoint(str(checkpoint))
        if fingerprint(path) != ref["fingerprint"]:
            raise TrainingError(
                f"{cfg.data.dir}'s reference log-probabilities were computed with {ref['checkpoint']}, whose files "
                f"differ from model.checkpoint={checkpoint}: prepare the pairs again with --checkpoint {checkpoint}"
            )
        if bool(ref["quantized"]) != cfg.lora.quantized:
            how = "quantized weights (--quantized)" if ref["quantized"] else "float weights"
            raise TrainingError(
                f"{cfg.data.dir}'s reference was computed with the checkpoint's {how}; set lora.quantized="
                f"{str(bool(ref['quantized'])).lower()} or prepare the pairs again to match"
            )

    def attach(self, model: Model) -> nn.Module:
        assert isinstance(model, DecoderLM)
        c = self.cfg.loss
        return PreferenceModule(model, self.kind, c.preference_beta, c.preference_gamma)

    def hooks(self, model: Model) -> list[Hook]:
        return []

    def micro_batch(self) -> tuple[int, str, int, int]:
        """Two sequences a pair, each up to seq_len tokens."""
        d = self.cfg.data
        return 2 * d.batch_size * d.seq_len, "data.batch_size", d.batch_size, 2 * d.seq_len

    def forward_flops_per_token(self, config: ModelConfig | RNNConfig) -> float | None:
        return None  # the padded rows' work is not the tokens read

    def _pair_batch(self, split: str, pairs: np.ndarray) -> tuple[tuple[Tensor, ...], int]:
        data = self.pairs.split(split)
        rows = [[2 * int(k) + side] for k in pairs for side in (0, 1)]
        width = max(int(data.lengths()[row[0]]) - 1 for row in rows)
        x, y, seg = row_arrays(data, rows, width, self.pairs.pad_id)
        reference = self.pairs.reference.get(split) if self.kind != "simpo" else None
        ref = np.asarray(reference[pairs], dtype=np.float32) if reference is not None else np.zeros((0, 2), np.float32)
        tensors = tuple(torch.from_numpy(a).to(self.rt.device, non_blocking=True) for a in (x, y, ref))
        return tensors, int((seg >= 0).sum())

    def batch(self, step: int, micro: int) -> tuple[tuple[Tensor, ...], int]:
        """(inputs, targets, reference) of this process's pairs for (step, micro-step), and the tokens they hold."""
        B = self.cfg.data.batch_size
        n = len(self.pairs.split("train")) // 2
        first = ((step * self.cfg.train.grad_accum + micro) * self.rt.world + self.rt.rank) * B
        picks = [self._order(epoch)[k] for epoch, k in (divmod(g, n) for g in range(first, first + B))]
        return self._pair_batch("train", np.array(picks))

    def eval_batches(self, full: bool) -> Iterator[tuple[Tensor, ...]]:
        """The validation pairs in order (all of them when `full`, else about train.eval_tokens' worth)."""
        split = self.eval_split
        n = len(self.pairs.split(split)) // 2
        if not full:
            per_pair = max(1, int(self.pairs.split(split).offsets[-1]) // max(n, 1))
            n = min(n, max(1, self.cfg.train.eval_tokens // per_pair))
        mine = np.arange(n)[self.rt.rank :: self.rt.world]
        B = self.cfg.data.batch_size
        for i in range(0, len(mine), B):
            yield self._pair_batch(split, mine[i : i + B])[0]

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        """The preference loss, reward accuracy and margin averaged over the evaluation pairs."""
        pairs = max(sums["pairs"], 1.0)
        return {
            "val_loss": sums["loss"] / pairs,
            "val_reward_accuracy": sums["reward_accuracy"] / pairs,
            "val_reward_margin": sums["reward_margin"] / pairs,
        }

    @property
    def chars_per_token(self) -> float:
        return float("nan")  # the answers are scored as wholes, not per character


class GRPOTask(Task):
    """GRPO on rl.prompts (train/grpo.py): each step's rollouts sampled by the serving engine on the model being
    trained, data.batch_size prompts of rl.group completions, rl.iterations steps on each batch of rollouts, the
    micro-batches (train.grad_accum) its slices. Prompts come in a shuffled order that changes every epoch and
    rollouts are seeded by the step, so a resumed run samples what the uninterrupted one did (at a step where new
    rollouts begin). Evaluation: greedy answers to the held-out prompts, their mean reward."""

    terms = GRPO_TERMS

    def __init__(self, cfg: TrainConfig, rt: Runtime) -> None:
        from llmkit.data.prepare import load_tokenizer

        super().__init__(cfg, rt)
        rl = cfg.rl
        assert rl.prompts is not None
        if rt.world != 1:
            raise TrainingError("rl.prompts: GRPO runs in one process (its engine shares the model's weights)")
        n = cfg.data.batch_size * rl.group
        if n % cfg.train.grad_accum:
            raise TrainingError(f"train.grad_accum={cfg.train.grad_accum} must divide the step's {n} completions "
                                f"(data.batch_size={cfg.data.batch_size} x rl.group={rl.group})")  # fmt: skip
        self.tokenizer = load_tokenizer(cfg.model["checkpoint"])
        self.examples = read_prompts(rl.prompts, self.tokenizer, rl.val_fraction)
        names = [*rl.rewards, *(["reward_model"] if rl.reward_model else [])]
        self.eval_terms = ("reward", "count", *(f"reward_{name}" for name in names))
        self.sampler: Sampler | None = None
        self._rollouts: tuple[int, Rollouts] | None = None  # (the step they were sampled at, the rollouts)
        self._order = EpochOrder(len(self.examples["train"]), cfg.train.seed)

    @property
    def vocab_size(self) -> int:
        assert self.tokenizer is not None
        return self.tokenizer.vocab_size

    def check_model(self, config: ModelConfig | RNNConfig) -> None:
        if not isinstance(config, ModelConfig) or config.is_encoder_decoder:
            raise TrainingError("rl.prompts: GRPO trains decoder-only language models")

    def attach(self, model: Model) -> nn.Module:
        assert isinstance(model, DecoderLM) and self.tokenizer is not None
        reference = None
        if self.cfg.rl.kl_beta:  # the model as it starts, frozen (before a resumed run's weights are restored)
            reference = copy.deepcopy(model).eval().requires_grad_(False)
        self.sampler = Sampler(model, self.tokenizer, self.examples, self.cfg.rl)
        return GRPOModule(model, self.sampler, self.cfg.rl, reference)

    def micro_batch(self) -> tuple[int, str, int, int]:
        """A micro-batch's completions, each up to the longest prompt and rl.max_new_tokens."""
        rl, d = self.cfg.rl, self.cfg.data
        per = max(len(e.ids) for e in self.examples["train"]) + rl.max_new_tokens
        rows = d.batch_size * rl.group // self.cfg.train.grad_accum
        return rows * per, "data.batch_size", d.batch_size, per * rl.group // self.cfg.train.grad_accum

    def batch(self, step: int, micro: int) -> tuple[tuple[Tensor, ...], int]:
        """(inputs, targets, old, scored, advantages, stats) of this micro-step's completions; new rollouts every
        rl.iterations steps, scored again by the engine under the current weights at the later ones."""
        assert self.sampler is not None
        rl, P = self.cfg.rl, self.cfg.data.batch_size
        start = step - step % rl.iterations
        if self._rollouts is None or self._rollouts[0] != start:
            n = len(self.examples["train"])
            picks = [int(self._order(e)[k]) for e, k in (divmod(start // rl.iterations * P + i, n) for i in range(P))]
            seed = (self.cfg.train.seed * 1_000_003 + start) % 2**31
            self._rollouts = start, self.sampler.rollouts(picks, seed)
        rollouts = self._rollouts[1]
        if micro == 0 and step != start:  # the weights moved since the rollouts: the engine scores them again
            rollouts.scored = {step: self.sampler.score(rollouts.prompts, rollouts.completions)}
        per = len(rollouts) // self.cfg.train.grad_accum
        rows = list(range(micro * per, (micro + 1) * per))
        pad = self.tokenizer.eos_id if self.tokenizer is not None and self.tokenizer.eos_id is not None else 0
        inputs, targets, old, scored = rollout_rows(rollouts, rows, pad, rollouts.scored.get(step))
        tokens = float(np.mean([len(c) for c in rollouts.completions]))
        stats = torch.tensor([float(rollouts.rewards.mean()), float(rollouts.rewards.std()), tokens])
        tensors = (inputs, targets, old, scored, rollouts.advantages[rows], stats)
        real = sum(len(rollouts.prompts[i]) + len(rollouts.completions[i]) for i in rows)
        return tuple(t.to(self.rt.device) for t in tensors), real

    def eval_batches(self, full: bool) -> Iterator[tuple[Tensor, ...]]:
        """The held-out prompts (the training ones where none are held out), all of them when `full`, else the
        first rl.eval_prompts; one batch (the engine batches them)."""
        split = "val" if self.examples["val"] else "train"
        n = len(self.examples[split])
        yield (torch.arange(n if full else min(n, self.cfg.rl.eval_prompts)),)

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        """The mean reward of the greedy answers, in all and per reward function."""
        count = max(sums["count"], 1.0)
        return {f"val_{k}": v / count for k, v in sums.items() if k.startswith("reward")}

    @property
    def chars_per_token(self) -> float:
        return float("nan")  # rewards, not text, are what the evaluation reads
