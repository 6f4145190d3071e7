"""The training loop: one loop for every model and task, configured by a TrainConfig.

    for step in steps:
        lr for this step (schedule, times each hook's scale for its group)
        for each micro-step: batch -> forward (autocast) -> loss / grad_accum -> backward
        clip gradients, optimizer step, hooks (e.g. MoE router-bias update)
        log (loss terms, lr, tokens/s, MFU) · evaluate (val loss, perplexity, bits per character) · checkpoint

The loop knows none of what varies between runs. What a batch is and what loss it gives is the task's (tasks.py:
a token stream, conversations, sentence pairs, a model's own text); where the model comes from is its source's
(source.py: a config, a checkpoint, a graft); which weights train, what a checkpoint holds and how one is read back is
the fine-tuning strategy's (strategy.py: full, partial, LoRA, QLoRA); how the arithmetic is done is the precision's
(precision.py: autocast dtype, fp16's gradient scaler); when the run ends and how its schedule fits the time is the
time budget's (budget.py); how the model is spread over processes, and so how its gradients are clipped and its
state saved and restored, is the spread's (spread.py: replicated for none / DDP / FSDP, split for FSDP + TP); what
some architectures need besides (router bias updates, an indexer's warm-up) comes in as hooks (hooks.py).
Exactness: batches are a function of the step, the learning rate is recomputed from the step, and checkpoints keep
the optimizer and every RNG, so a resumed run continues bit for bit. Safety: a non-finite loss or gradient stops
the run with the step where it happened; Ctrl-C (or SIGTERM) finishes the current step, saves, and exits.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from llmkit.errors import ConfigError, OutputError
from llmkit.machine.perf import matmul_flops, tune_allocator
from llmkit.outputs import DESCRIBED, check_not_input, found_at
from llmkit.runs import latest_checkpoint
from llmkit.train import checkpoint as ckpt
from llmkit.train.budget import FIT_MARGIN, FIT_SHARE, FIT_SKIP, FIT_WINDOW, TimeBudget
from llmkit.train.config import TrainConfig
from llmkit.train.control import StopSignal, resolve_precision
from llmkit.train.memory import check_fits
from llmkit.train.metrics import MetricsLog
from llmkit.train.optim import build_optimizer
from llmkit.train.parallel import (
    agree,
    all_reduce_sum,
    checkpoint_activations,
    compile_blocks,
    setup,
    teardown,
)
from llmkit.train.precision import Precision
from llmkit.train.schedule import lr_multiplier
from llmkit.train.source import Model, ModelSource, TrainingError, model_source
from llmkit.train.spread import Replicated, SplitLayers
from llmkit.train.strategy import FineTuning, Full, from_config
from llmkit.train.tasks import build_task
from llmkit.train.tensor_parallel import (
    split_for_training,
)

__all__ = ["FIT_MARGIN", "FIT_SHARE", "FIT_SKIP", "FIT_WINDOW", "Result", "Trainer", "TrainingError", "train"]


@dataclass
class Result:
    steps: int
    tokens: int
    seconds: float
    val_loss: float | None
    val_bpc: float | None
    checkpoint: Path | None
    interrupted: bool
    main: bool = True  # whether this process is the main one (rank 0), which wrote the checkpoints


class Trainer:
    """Builds everything a run needs from its config; `run()` trains."""

    # the clock the time budget, the fitted schedule and the throughput read: tests replace it with one that
    # advances a fixed amount per step, so what they check does not depend on how fast or busy the machine is
    clock = staticmethod(time.perf_counter)

    def __init__(
        self,
        cfg: TrainConfig,
        *,
        resume: bool = False,
        fine_tuning: FineTuning | None = None,
        source: ModelSource | None = None,
    ) -> None:
        """fine_tuning: what trains and what is saved (default: what the config asks for, strategy.from_config);
        source: where the model comes from (default: the config's model section, source.model_source)."""
        self.cfg = cfg
        t = cfg.train
        if t.precision == "fp16" and not torch.cuda.is_available():
            raise TrainingError("train.precision='fp16' needs CUDA (its gradient scaling); use 'bf16' on CPU")
        tune_allocator()  # reuse the large per-step buffers instead of faulting in fresh pages each step
        self.out = Path(t.out)
        check_run_folder(cfg)
        self.rt = setup(t.parallel, t.device, t.tp)
        # "auto": bf16 only where it is fast
        self.precision = Precision(resolve_precision(t.precision, self.rt.device), self.rt.device)
        if self.rt.main:  # before a resume looks for its checkpoint: a full disk's leftover would keep it full
            for note in ckpt.remove_leftovers(self.out):
                print(f"note: {note}", file=sys.stderr)
        self.task = build_task(cfg, self.rt)
        self.source = source if source is not None else model_source(cfg, self.task.vocab_sizes, self.task.tokenizer)
        self.task.check_model(self.source.config)
        if self.source.config.vocab_size < self.task.vocab_size:
            raise TrainingError(
                f"model vocab_size={self.source.config.vocab_size} is smaller than the data's {self.task.vocab_size}"
            )
        self.fine_tuning = fine_tuning if fine_tuning is not None else from_config(cfg, self.source.checkpoint)
        tokens, setting, value, unit = self.task.micro_batch()
        check_fits(self.source.config, tokens, self.rt.device, setting, value, unit)  # before any allocation
        torch.manual_seed(t.seed)  # the same initial weights in every process
        self.model: Model = self.source.build(self.rt.device)
        described = self.fine_tuning.prepare(self.model)
        self.spread = Replicated(t.parallel, self.rt) if self.rt.tp is None else self._split()
        if described and self.rt.main and t.progress:
            print(described)
        self.state = ckpt.TrainState(step=0, tokens=0, elapsed=0.0)
        resumed = self._resumed(resume)
        if t.activation_checkpointing:
            checkpoint_activations(self.model)
        if t.compile:
            compile_blocks(self.model)
        self.runner = self.task.attach(self.model)
        self.hooks = self.task.hooks(self.model)
        self.wrapped = self.spread.wrap(self.runner)
        self.optimizer = build_optimizer(self.model, cfg.optim, self._group_of)
        if resumed is not None:
            state = self.fine_tuning.restore(self.model, resumed.model_state)
            self.spread.load(self.runner, self.optimizer, state, resumed.optimizer)
            ckpt.set_rng_state(resumed.rng)
        # not the groups' lr: a resumed optimizer holds the learning rate of its last step
        self.base_lr = cfg.optim.lr
        self.lr_at = lr_multiplier(cfg.schedule, self.total_steps)
        self.budget = TimeBudget(
            t.time_limit, t.fit_to_time, t.steps, self.rt, self.state.planned_steps, self.state.step
        )
        self.metrics = MetricsLog(self.out, enabled=self.rt.main)
        self.metrics.truncate(self.state.step)  # a fresh run starts a fresh log; a resumed one drops what it redoes
        # model FLOPs per training token, for MFU: the forward's times what the backward adds to it
        forward, factor = self.task.forward_flops_per_token(self.source.config), self.fine_tuning.backward_factor
        self.flops_per_token = forward * factor if forward is not None and factor is not None else None
        self.peak_flops: float | None = None
        self.resumed_from = resumed.path if resumed else None
        if self.rt.main:
            self.out.mkdir(parents=True, exist_ok=True)
            cfg.to_yaml(self.out / "config.yaml")

    def _resumed(self, resume: bool) -> ckpt.Resumed | None:
        if not resume:
            if latest_checkpoint(self.out) is not None:
                raise TrainingError(
                    f"{self.out} already holds a run with checkpoints: continue it with --resume, or start a new "
                    "run elsewhere (--set train.out=...) or after removing that folder"
                )
            return None
        path = latest_checkpoint(self.out)
        if path is None:
            raise ckpt.ResumeError(f"nothing to resume in {self.out}: no complete checkpoint found")
        resumed = ckpt.load(path, self.source.config)
        self.state = resumed.state
        return resumed

    @property
    def total_steps(self) -> int:
        """The schedule's length: train.steps, or what fit_to_time fixed it to."""
        return self.state.planned_steps or self.cfg.train.steps

    def _split(self) -> SplitLayers:
        if not isinstance(self.fine_tuning, Full):
            raise ConfigError("train.parallel='fsdp+tp' trains every weight (pre-training or full fine-tuning)")
        assert self.rt.tp is not None
        return SplitLayers(self.rt, split_for_training(self.model, self.rt.tp), self.model)

    def _group_of(self, name: str) -> str | None:
        return next((g for hook in self.hooks if (g := hook.group(name)) is not None), None)

    # ---- one step

    def schedule_step(self, step: int) -> int:
        """Where the learning-rate schedule stands after `step` steps (TimeBudget.schedule_step)."""
        return self.budget.schedule_step(step, self.state.elapsed, self.state.planned_steps)

    def set_lr(self, step: int) -> float:
        mult = self.lr_at(self.schedule_step(step))
        for group in self.optimizer.param_groups:
            scale = math.prod(hook.lr_scale(step, str(group.get("name"))) for hook in self.hooks)
            group["lr"] = self.base_lr * mult * scale
        return self.base_lr * mult

    def train_step(self, step: int) -> tuple[torch.Tensor, int, float]:
        """Forward and backward over the micro-batches of `step`, clipping, the optimizer step and the hooks.
        Returns (the task's loss terms averaged over micro-steps and processes, tokens read, gradient norm)."""
        t = self.cfg.train
        options = {k: v for hook in self.hooks for k, v in hook.forward_options(step).items()}
        terms = torch.zeros(len(self.task.terms), device=self.rt.device)
        stats: dict[str, torch.Tensor] = {}
        read = torch.zeros(1, dtype=torch.float64, device=self.rt.device)
        for micro in range(t.grad_accum):
            args, n_tokens = self.task.batch(step, micro)
            last = micro == t.grad_accum - 1
            with self.spread.sync(last):
                with self.precision.autocast():
                    out = self.wrapped(*args, **options)
                self.precision.backward(out["loss"] / t.grad_accum)
            terms += torch.stack([out[name].detach().float() for name in self.task.terms]) / t.grad_accum
            for name, value in out.items():
                if name not in self.task.terms:
                    stats[name] = stats[name] + value.detach() if name in stats else value.detach()
            read += n_tokens
        self.precision.unscale(self.optimizer)
        grad_norm = self.spread.clip(self.model, self.cfg.optim.grad_clip)
        all_reduce_sum(terms, self.rt)
        all_reduce_sum(read, self.rt)
        terms /= self.rt.world
        if not (math.isfinite(float(terms[0])) and math.isfinite(grad_norm)):
            what = "loss" if not math.isfinite(float(terms[0])) else "gradient norm"
            raise TrainingError(
                f"non-finite {what} at step {step + 1} (loss {float(terms[0])}, gradient norm {grad_norm}): lower "
                "optim.lr, raise schedule.warmup_steps or use train.precision='fp32'; the last checkpoint is intact"
            )
        self.precision.step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        for hook in self.hooks:
            hook.after_step(stats, self.rt)
        return terms, int(read.item()), grad_norm

    @torch.no_grad()
    def evaluate(self, full: bool = False) -> dict[str, float]:
        """The task's metrics on the validation split (a fixed subset of train.eval_tokens unless `full`): for
        language models the loss per target token, perplexity and bits per character."""
        self.model.eval()
        names = self.task.eval_terms
        total = torch.zeros(len(names), dtype=torch.float64, device=self.rt.device)
        for args in self.task.eval_batches(full):
            with self.precision.autocast():
                out = self.wrapped(*args, evaluate=True)
            total += torch.stack([out[name].double() for name in names])
        self.model.train()
        all_reduce_sum(total, self.rt)
        return self.task.summarize(dict(zip(names, total.tolist(), strict=True)))

    def plot_title(self) -> str:
        params = sum(p.numel() for p in self.model.parameters())
        return f"{self.out.name}: {params / 1e6:.1f}M parameters, {self.state.tokens / 1e6:.2f}M tokens"

    def save(self) -> Path | None:
        state, optim_state = self.spread.state(self.runner, self.optimizer)
        if not self.rt.main:
            return None
        state = self.fine_tuning.saved(state)
        return ckpt.save(
            self.out,
            self.model,
            state,
            optim_state,
            self.state,
            self.cfg.train.keep_last,
            self.task.tokenizer,
            self.cfg.to_dict(),
            source_tokenizer=self.task.source_tokenizer,
            generation_config=self.task.generation_config,
            adapter=self.fine_tuning.adapter,
        )

    # ---- the loop

    def run(self) -> Result:
        t = self.cfg.train
        if self.rt.main and self.flops_per_token:
            # the best of three short measurements: the peak is the best sustained rate, and one window on a shared
            # machine can land on a slow moment (a run of SmolLM2 once read half the usual peak and showed MFU 109%)
            peak = max(matmul_flops(self.precision.dtype, self.rt.device, seconds=0.1) for _ in range(3))
            self.peak_flops = peak * self.rt.world * (self.rt.tp.world if self.rt.tp is not None else 1)
        bar = tqdm(
            total=self.total_steps,
            initial=self.state.step,
            disable=not (self.rt.main and t.progress),
            unit="step",
            dynamic_ncols=True,
            mininterval=0.5,
        )
        self.model.train()
        window_tokens, window_start = 0, self.clock()
        run_start = self.clock() - self.state.elapsed
        last_eval: dict[str, float] = {}
        saved: Path | None = None
        interrupted = False
        with StopSignal() as stop:
            while self.state.step < self.total_steps:
                lr = self.set_lr(self.state.step)
                terms, read, grad_norm = self.train_step(self.state.step)
                self.state.step += 1
                self.state.tokens += read
                window_tokens += read
                self.state.elapsed = self.clock() - run_start
                step = self.state.step
                if (planned := self.budget.fitted(step, self.state.elapsed)) is not None:
                    self.state.planned_steps = bar.total = planned
                    self.lr_at = lr_multiplier(self.cfg.schedule, planned)
                    if self.rt.main and t.progress:
                        bar.write(f"schedule fitted to train.time_limit={t.time_limit:g}s: {planned} steps")
                out_of_time = self.budget.out_of_time(self.state.elapsed)
                halted = t.halt_at is not None and step >= t.halt_at
                stop_now = agree(stop.requested or out_of_time or halted, self.rt)
                schedule_end = self.schedule_step(step) >= self.total_steps
                last = schedule_end or stop_now
                if step % t.log_every == 0 or last:
                    seconds = self.clock() - window_start
                    self._log(bar, terms, lr, grad_norm, window_tokens / max(seconds, 1e-9))
                    window_tokens, window_start = 0, self.clock()
                if step % t.eval_every == 0 or last:
                    last_eval = self.evaluate(full=last)
                    self.metrics.log({"step": step, "tokens": self.state.tokens, **last_eval})
                    self.metrics.plot(self.plot_title())
                    if self.rt.main and t.progress:
                        bar.write(f"step {step}: {describe(last_eval)}")
                if step % t.save_every == 0 or last:
                    saved = self.save() or saved
                bar.update(1)
                if stop_now:
                    interrupted = stop.requested
                    break
                if schedule_end:  # a fitted schedule may end by time before its last step
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
            main=self.rt.main,
        )

    def _log(self, bar: tqdm, terms: torch.Tensor, lr: float, grad_norm: float, tokens_per_s: float) -> None:
        s = self.state
        row: dict[str, float] = {"step": s.step, "tokens": s.tokens, "time": round(s.elapsed, 3)}
        row.update({k: float(v) for k, v in zip(self.task.terms, terms.tolist(), strict=True)})
        row.update(lr=lr, grad_norm=grad_norm, tokens_per_s=tokens_per_s)
        if self.peak_flops and self.flops_per_token:
            row["mfu"] = tokens_per_s * self.flops_per_token / self.peak_flops
        self.metrics.log(row)
        postfix = {"loss": f"{row['loss']:.3f}", "lr": f"{lr:.2e}", "tok_s": f"{tokens_per_s:,.0f}"}
        if "mfu" in row:
            postfix["mfu"] = f"{100 * row['mfu']:.1f}%"
        bar.set_postfix(postfix, refresh=False)

    def close(self, finished: bool = False) -> None:
        """Close the metrics and the process group (`finished`: the run ended on this rank without an error)."""
        try:
            with contextlib.suppress(OSError):  # a full disk: the error that stopped the run is the one to report
                self.metrics.close()
        finally:
            teardown(self.rt, finished)


def describe(metrics: dict[str, float]) -> str:
    """An evaluation's metrics in a line: "val loss 1.2345 bits/char 1.7810"."""
    shown = [(k.removeprefix("val_").replace("_", " ").replace("bpc", "bits/char"), v) for k, v in metrics.items()]
    return "val " + " ".join(f"{name} {v:.4f}" for name, v in shown if name != "ppl")


def check_run_folder(cfg: TrainConfig) -> None:
    """A TrainingError when train.out is not a place for a run: a checkpoint, a data folder or a file (whose files
    the run's config.yaml, metrics and checkpoints would mix with or overwrite), or one of the run's own inputs."""
    out = Path(cfg.train.out)
    found = found_at(out)
    if found in ("file", "checkpoint", "data"):
        raise TrainingError(
            f"train.out={cfg.train.out} is {DESCRIBED[found]}: a run is never written into one; choose another "
            "train.out (--set train.out=runs/NAME)"
        )
    inputs = [cfg.data.dir, cfg.model.get("checkpoint"), cfg.loss.distill_from]
    try:
        check_not_input(out, inputs)
    except OutputError as e:
        raise TrainingError(f"train.out: {e}") from None


def train(
    cfg: TrainConfig, *, resume: bool = False, fine_tuning: FineTuning | None = None, source: ModelSource | None = None
) -> Result:
    """Train according to `cfg` (resuming from the run folder's latest checkpoint if asked; see Trainer for the
    fine-tuning strategy and the model's source). Averaging checkpoints and scoring a test split are separate steps
    (see llmkit.cli.recipes)."""
    trainer = Trainer(cfg, resume=resume, fine_tuning=fine_tuning, source=source)
    finished = False
    try:
        result = trainer.run()
        finished = True
        return result
    finally:
        trainer.close(finished)
