"""The training loop: one loop for every model family, configured by a TrainConfig.

    for step in steps:
        lr for this step (schedule)
        for each micro-step: batch -> forward (autocast) -> loss / grad_accum -> backward
        clip gradients, optimizer step; MoE router-bias update
        log (loss, lr, tokens/s, MFU) · evaluate (val loss, perplexity, bits per character) · checkpoint

Exactness: batches are a function of the step, the learning rate is recomputed from the step, and checkpoints keep
the optimizer and every RNG, so a resumed run continues bit for bit. Safety: a non-finite loss or gradient stops the
run with the step where it happened; Ctrl-C (or SIGTERM) finishes the current step, saves, and exits.
"""

from __future__ import annotations

import contextlib
import math
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from llmkit.analysis import analyze
from llmkit.config import ModelConfig
from llmkit.data.parallel import ParallelData, is_parallel
from llmkit.errors import LLMKitError
from llmkit.layers.moe import MoE, update_router_bias
from llmkit.models import DecoderLM, EncoderDecoder, RNNConfig, RNNSeq2Seq, build_any
from llmkit.tokenizer import Tokenizer
from llmkit.train import checkpoint as ckpt
from llmkit.train.config import TrainConfig
from llmkit.train.data import TokenData
from llmkit.train.metrics import MetricsLog, bits_per_char
from llmkit.train.optim import build_optimizer
from llmkit.train.parallel import (
    Runtime,
    all_reduce_sum,
    checkpoint_activations,
    compile_blocks,
    full_state,
    load_full_state,
    setup,
    teardown,
    wrap,
)
from llmkit.train.schedule import lr_multiplier
from llmkit.train.tasks import TERMS, LanguageModelTask, TranslationTask


class TrainingError(LLMKitError, RuntimeError):
    """Training cannot go on (a non-finite loss, an unusable configuration)."""


@dataclass
class Result:
    steps: int
    tokens: int
    seconds: float
    val_loss: float | None
    val_bpc: float | None
    checkpoint: Path | None
    interrupted: bool
    averaged: Path | None = None  # the averaged checkpoint (train.average_last)
    test_scores: dict[str, Any] | None = None  # translation: BLEU, chrF and more on the test split


class _Stop:
    """Turns the first SIGINT/SIGTERM into a request to stop after the current step; a second one interrupts."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _Stop:
        with contextlib.suppress(ValueError):  # not the main thread: no handlers
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def _strip(state: dict[str, Any], prefix: str = "model.") -> dict[str, Any]:
    return {k.removeprefix(prefix): v for k, v in state.items()}


def _optimizer_state(raw: dict[str, Any], add: str = "", strip: str = "") -> dict[str, Any]:
    """Re-key a name-keyed optimizer state between the training wrapper ('model.' prefix) and checkpoints."""

    def rename(n: str) -> str:
        return add + n.removeprefix(strip)

    return {
        "state": {rename(k): v for k, v in raw.get("state", {}).items()},
        "param_groups": [{**g, "params": [rename(p) for p in g["params"]]} for g in raw.get("param_groups", [])],
    }


def _move(model_state: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device) for k, v in model_state.items()}


class Trainer:
    """Builds everything a run needs from its config; `run()` trains."""

    def __init__(self, cfg: TrainConfig, *, resume: bool = False) -> None:
        self.cfg = cfg
        t = cfg.train
        if t.precision == "fp16" and not torch.cuda.is_available():
            raise TrainingError("train.precision='fp16' needs CUDA (its gradient scaling); use 'bf16' on CPU")
        from llmkit.perf import tune_allocator

        tune_allocator()  # reuse the large per-step buffers instead of faulting in fresh pages each step
        self.rt: Runtime = setup(t.parallel, t.device)
        self.out = Path(t.out)
        self.translation = is_parallel(cfg.data.dir)
        self.source_tokenizer: Tokenizer | None = None
        self.tokenizer: Tokenizer | None
        self.generation_config: dict[str, Any] = {}
        self.data: TokenData | ParallelData
        self.model_cfg: ModelConfig | RNNConfig
        if self.translation:
            pairs = ParallelData(cfg.data.dir)
            self.data = pairs
            self.model_cfg = cfg.model_config(
                vocab_size=pairs.vocab_size, src_vocab_size=None if pairs.shared_vocab else pairs.src_vocab_size
            )
            if not self.model_cfg.is_encoder_decoder:
                raise TrainingError(
                    f"{cfg.data.dir} holds sentence pairs: translation needs an encoder-decoder model (e.g. "
                    "model.preset=transformer-base, or model.arch=rnn), not a decoder-only one"
                )
            self.source_tokenizer, self.tokenizer = pairs.tokenizers()
            self.generation_config = {
                "decoder_start_token_id": pairs.bos_id,
                "eos_token_id": pairs.eos_id,
                "pad_token_id": pairs.pad_id,
                "bad_words_ids": [[pairs.pad_id], [pairs.bos_id]],
            }
        else:
            tokens = TokenData(cfg.data.dir)
            self.data = tokens
            self.model_cfg = cfg.model_config(vocab_size=tokens.vocab_size)
            if self.model_cfg.is_encoder_decoder:
                raise TrainingError(
                    f"{cfg.data.dir} holds a token stream: language-model training needs a decoder-only model (this "
                    "config has an encoder; encoder-decoder models train on sentence pairs)"
                )
            self.tokenizer = Tokenizer.from_dir(tokens.dir)
        if self.model_cfg.vocab_size < self.data.vocab_size:
            raise TrainingError(
                f"model vocab_size={self.model_cfg.vocab_size} is smaller than the data's {self.data.vocab_size}"
            )
        if isinstance(self.model_cfg, RNNConfig) and (t.compile or t.activation_checkpointing):
            raise TrainingError("train.compile and train.activation_checkpointing apply to Transformer models only")
        torch.manual_seed(t.seed)  # the same initial weights in every process
        self.model = build_any(self.model_cfg, device=self.rt.device)
        self.state = ckpt.TrainState(step=0, tokens=0, elapsed=0.0)
        resumed: ckpt.Resumed | None = None
        if not resume and ckpt.latest_checkpoint(self.out) is not None:
            raise TrainingError(
                f"{self.out} already holds a run with checkpoints: continue it with --resume, or start a new run "
                "elsewhere (--set train.out=...) or after removing that folder"
            )
        if resume:
            path = ckpt.latest_checkpoint(self.out)
            if path is None:
                raise ckpt.ResumeError(f"nothing to resume in {self.out}: no complete checkpoint found")
            resumed = ckpt.load(path, self.model_cfg)
            self.state = resumed.state
        if t.activation_checkpointing:
            checkpoint_activations(self.model)
        if t.compile:
            compile_blocks(self.model)
        self.task: LanguageModelTask | TranslationTask
        if isinstance(self.data, ParallelData):
            assert isinstance(self.model, (EncoderDecoder, RNNSeq2Seq))
            self.task = TranslationTask(self.data, cfg, self.rt, self.model)
        else:
            assert isinstance(self.model, DecoderLM)
            self.task = LanguageModelTask(self.data, cfg, self.rt, self.model)
        self.runner = self.task.module
        self.wrapped = wrap(self.runner, t.parallel, self.rt, find_unused=False)
        self.optimizer = build_optimizer(self.model, cfg.optim)
        if resumed is not None:
            load_full_state(
                self.runner,
                self.optimizer,
                {"model." + k: v for k, v in _move(resumed.model_state, self.rt.device).items()},
                _optimizer_state(resumed.optimizer, add="model."),
            )
            ckpt.set_rng_state(resumed.rng)
        self.base_lrs = [cfg.optim.lr for _ in self.optimizer.param_groups]  # not the groups' lr: a resumed
        # optimizer holds the learning rate of its last step
        self.lr_at = lr_multiplier(cfg.schedule, t.steps)
        self.scaler = torch.amp.GradScaler("cuda") if t.precision == "fp16" else None
        self.metrics = MetricsLog(self.out, enabled=self.rt.main)
        self.metrics.truncate(self.state.step)  # a fresh run starts a fresh log; a resumed one drops what it redoes
        self.flops_per_token: float | None = None  # model FLOPs per training token, for MFU (language models)
        if isinstance(self.model_cfg, ModelConfig) and not self.model_cfg.is_encoder_decoder:
            self.flops_per_token = 3 * analyze(self.model_cfg, seq_len=cfg.data.seq_len).flops_per_token
        self.peak_flops: float | None = None
        self.resumed_from = resumed.path if resumed else None
        if self.rt.main:
            self.out.mkdir(parents=True, exist_ok=True)
            cfg.to_yaml(self.out / "config.yaml")

    # ---- pieces

    @property
    def sparse(self) -> bool:
        return bool(getattr(self.runner, "sparse", None))

    def set_lr(self, step: int) -> float:
        mult = self.lr_at(step)
        warming = step < self.cfg.loss.indexer_warmup_steps and self.sparse
        for group, base in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
            group["lr"] = base * mult * (0.0 if warming and group.get("name") != "indexer" else 1.0)
        return self.base_lrs[0] * mult

    def indexer_phase(self, step: int) -> None:
        if self.sparse:
            phase = "dense" if step < self.cfg.loss.indexer_warmup_steps else "sparse"
            self.runner.set_indexer_phase(phase)  # type: ignore[operator,arg-type]

    def micro_step(self, step: int, micro: int, last: bool) -> tuple[torch.Tensor, int]:
        """Forward and backward of one micro-batch: (its loss terms, the tokens this process read)."""
        args, n_tokens = self.task.batch(step, micro)
        sync = contextlib.nullcontext()
        if not last and hasattr(self.wrapped, "no_sync"):  # DDP: reduce gradients once, on the last micro-step
            sync = self.wrapped.no_sync()  # type: ignore[operator]
        with sync:
            with _autocast(self.cfg.train.precision, self.rt.device):
                terms = self.wrapped(*args)
            loss = terms[0] / self.cfg.train.grad_accum
            if self.scaler is not None:
                self.scaler.scale(loss).backward()
            else:
                loss.backward()
        return torch.stack([t.detach().float() for t in terms]), n_tokens

    def moe_bias_update(self) -> None:
        moe = [m for m in self.model.modules() if isinstance(m, MoE) and m.router.score_bias is not None]
        if not moe or self.cfg.loss.moe_bias_update_rate == 0:
            return
        for m in moe:  # every process applies the same update, from the load of the whole batch
            all_reduce_sum(m.load, self.rt)
        update_router_bias(self.model, self.cfg.loss.moe_bias_update_rate)

    @torch.no_grad()
    def evaluate(self, full: bool = False) -> dict[str, float]:
        """Loss per target token on the validation split (a fixed subset of train.eval_tokens unless `full`)."""
        self.model.eval()
        total = torch.zeros(2, dtype=torch.float64, device=self.rt.device)
        for args in self.task.eval_batches(full):
            with _autocast(self.cfg.train.precision, self.rt.device):
                nll, count = self.wrapped(*args, evaluate=True)
            total += torch.stack([nll.double(), count.double()])
        self.model.train()
        all_reduce_sum(total, self.rt)
        loss = float(total[0] / total[1])
        return {
            "val_loss": loss,
            "val_ppl": math.exp(min(loss, 50.0)),
            "val_bpc": bits_per_char(loss, self.task.chars_per_token),
        }

    def plot_title(self) -> str:
        params = sum(p.numel() for p in self.model.parameters())
        return f"{self.out.name}: {params / 1e6:.1f}M parameters, {self.state.tokens / 1e6:.2f}M tokens"

    def save(self) -> Path | None:
        model_state, optim_state = full_state(self.runner, self.optimizer)
        if not self.rt.main:
            return None
        return ckpt.save(
            self.out,
            self.model,
            _strip(model_state),
            _optimizer_state(optim_state, strip="model."),
            self.state,
            self.cfg.train.keep_last,
            self.tokenizer,
            self.cfg.to_dict(),
            source_tokenizer=self.source_tokenizer,
            generation_config=self.generation_config,
        )

    # ---- the loop

    def run(self) -> Result:
        t = self.cfg.train
        if self.rt.main and self.flops_per_token:
            from llmkit.perf import matmul_flops

            dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[t.precision]
            self.peak_flops = matmul_flops(dtype, self.rt.device, seconds=0.3) * self.rt.world
        from tqdm import tqdm

        bar = tqdm(
            total=t.steps,
            initial=self.state.step,
            disable=not (self.rt.main and t.progress),
            unit="step",
            dynamic_ncols=True,
            mininterval=0.5,
        )
        self.model.train()
        window_tokens, window_start = 0, time.perf_counter()
        run_start = time.perf_counter() - self.state.elapsed
        last_eval: dict[str, float] = {}
        saved: Path | None = None
        interrupted = False
        with _Stop() as stop:
            while self.state.step < t.steps:
                step = self.state.step
                lr = self.set_lr(step)
                self.indexer_phase(step)
                terms = torch.zeros(len(TERMS), device=self.rt.device)
                read = torch.zeros(1, dtype=torch.float64, device=self.rt.device)
                for micro in range(t.grad_accum):
                    micro_terms, n_tokens = self.micro_step(step, micro, micro == t.grad_accum - 1)
                    terms += micro_terms / t.grad_accum
                    read += n_tokens
                if self.scaler is not None:
                    self.scaler.unscale_(self.optimizer)
                grad_norm = self._clip()
                all_reduce_sum(terms, self.rt)
                all_reduce_sum(read, self.rt)
                terms /= self.rt.world
                if not (math.isfinite(float(terms[0])) and math.isfinite(grad_norm)):
                    raise TrainingError(
                        f"non-finite {'loss' if not math.isfinite(float(terms[0])) else 'gradient norm'} at step "
                        f"{step + 1} (loss {float(terms[0])}, gradient norm {grad_norm}): lower optim.lr, raise "
                        "schedule.warmup_steps or use train.precision='fp32'; the last checkpoint is intact"
                    )
                if self.scaler is not None:
                    self.scaler.step(self.optimizer)
                    self.scaler.update()
                else:
                    self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                self.moe_bias_update()
                self.state.step += 1
                self.state.tokens += int(read.item())
                window_tokens += int(read.item())
                self.state.elapsed = time.perf_counter() - run_start
                step = self.state.step
                out_of_time = t.time_limit is not None and self.state.elapsed >= t.time_limit
                halted = t.halt_at is not None and step >= t.halt_at
                stop_now = self._agree(stop.requested or out_of_time or halted)
                last = step >= t.steps or stop_now
                if step % t.log_every == 0 or last:
                    seconds = time.perf_counter() - window_start
                    tps = window_tokens / max(seconds, 1e-9)
                    row = {"step": step, "tokens": self.state.tokens, "time": round(self.state.elapsed, 3)}
                    row.update({k: float(v) for k, v in zip(TERMS, terms.tolist(), strict=True)})
                    row.update(lr=lr, grad_norm=grad_norm, tokens_per_s=tps)
                    if self.peak_flops and self.flops_per_token:
                        row["mfu"] = tps * self.flops_per_token / self.peak_flops
                    self.metrics.log(row)
                    postfix = {"loss": f"{row['loss']:.3f}", "lr": f"{lr:.2e}", "tok_s": f"{tps:,.0f}"}
                    if "mfu" in row:
                        postfix["mfu"] = f"{100 * row['mfu']:.1f}%"
                    bar.set_postfix(postfix, refresh=False)
                    window_tokens, window_start = 0, time.perf_counter()
                if step % t.eval_every == 0 or last:
                    last_eval = self.evaluate(full=last)
                    self.metrics.log({"step": step, "tokens": self.state.tokens, **last_eval})
                    self.metrics.plot(self.plot_title())
                    if self.rt.main and t.progress:
                        bar.write(
                            f"step {step}: val loss {last_eval['val_loss']:.4f} bits/char {last_eval['val_bpc']:.4f}"
                        )
                if step % t.save_every == 0 or last:
                    saved = self.save() or saved
                bar.update(1)
                if stop_now:
                    interrupted = stop.requested
                    break
        bar.close()
        self.metrics.close()
        return Result(
            steps=self.state.step,
            tokens=self.state.tokens,
            seconds=self.state.elapsed,
            val_loss=last_eval.get("val_loss"),
            val_bpc=last_eval.get("val_bpc"),
            checkpoint=saved,
            interrupted=interrupted,
        )

    def _clip(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        clip = self.cfg.optim.grad_clip
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def _agree(self, flag: bool) -> bool:
        """All processes stop at the same step if any of them wants to."""
        if not self.rt.distributed:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=self.rt.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def close(self) -> None:
        teardown(self.rt)


def train(cfg: TrainConfig, *, resume: bool = False) -> Result:
    """Train according to `cfg` (resuming from the run folder's latest checkpoint if asked)."""
    trainer = Trainer(cfg, resume=resume)
    try:
        result = trainer.run()
    finally:
        trainer.close()
    if result.interrupted or not trainer.rt.main:
        return result
    t = cfg.train
    if t.average_last:
        from llmkit.train.average import average_run

        result.averaged = average_run(t.out, t.average_last)
        if t.progress:
            print(f"averaged the last {t.average_last} checkpoints: {result.averaged}")
    if trainer.translation and cfg.translate.score_test:
        from llmkit.translate.scores import score_test

        tr = cfg.translate
        result.test_scores = score_test(result.averaged or result.checkpoint or t.out, cfg.data.dir, out=t.out,
                                        beams=tr.beams, length_penalty=tr.length_penalty, limit=tr.test_pairs,
                                        batch_size=tr.batch_size, progress=t.progress)  # fmt: skip
    return result
