"""Training commands: train a model from a YAML config, average a run's last checkpoints, merge LoRA adapters, graft
a drafting MTP module onto a pretrained model, distil a draft model out of one."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, cast

from llmkit.outputs import Output, building, claim, overlaps


def train(
    config: str | None = None,
    *,
    set_: list[str] | None = None,
    resume: bool = False,
    parallel: Literal["none", "ddp", "fsdp", "fsdp+tp"] | None = None,
    tp: int | None = None,
) -> int:
    """Train a model on prepared data: progress bar, metrics, loss plot, checkpoints.

    config: a YAML training config (sections model, data, optim, schedule, train, loss); defaults if omitted.
    set_: override a config value, e.g. --set optim.lr=3e-4 --set model.n_layers=6 (repeatable).
    resume: continue from the latest checkpoint in train.out, exactly where it stopped.
    parallel: data parallelism under torchrun: ddp or fsdp (the same as --set train.parallel=...); fsdp+tp splits
        the model across --tp processes (tensor parallelism) and shards it with FSDP across the rest.
    tp: with --parallel fsdp+tp, how many processes split the model (the same as --set train.tp=...).
    """
    from llmkit.cli.recipes import train_and_evaluate
    from llmkit.train.config import load_train_config

    overrides = list(set_ or [])
    if parallel is not None:
        overrides.append(f"train.parallel={parallel}")
    if tp is not None:
        overrides.append(f"train.tp={tp}")
    cfg = load_train_config(config, overrides)
    done = train_and_evaluate(cfg, resume=resume)
    result = done.training
    if not result.main:  # another process of a torchrun launch: the main one reports
        return 0
    state = "interrupted; resume with --resume" if result.interrupted else "done"
    bpc = f", val bits/char {result.val_bpc:.4f}" if result.val_bpc is not None else ""
    loss = f", val loss {result.val_loss:.4f}" if result.val_loss is not None else ""
    print(f"{state}: {result.steps} steps, {result.tokens:,} tokens in {result.seconds:.0f} s{loss}{bpc}")
    if result.checkpoint is not None:
        print(f"checkpoint: {result.checkpoint}")
    if done.test_scores is not None:
        print(f"test scores: {Path(cfg.train.out) / 'test_scores.json'}")
    print(f"loss plot: {Path(cfg.train.out) / 'loss.png'}")
    return 0


def average(run: str, *, last: int = 5, out: str | None = None, overwrite: bool = False) -> int:
    """Average the weights of a run's last checkpoints (as the paper did for its base models).

    run: a training run folder.
    last: how many of its newest checkpoints to average.
    out: where to write the averaged checkpoint (default RUN/averaged, which each average replaces).
    overwrite: replace an existing checkpoint at --out.
    """
    from llmkit.train.average import average_run

    path = average_run(run, last, out, overwrite=overwrite)
    print(f"averaged the last {last} checkpoints of {run} -> {path}")
    return 0


def merge(run: str, out: str, *, overwrite: bool = False) -> int:
    """Fold a LoRA run's adapters into its base checkpoint's weights: a plain checkpoint, as fast as the base.

    run: a LoRA fine-tuning run (its latest checkpoint), one of its checkpoints, or a folder PEFT saved.
    out: where to write the merged llmkit checkpoint (`llmkit convert` turns it into Hugging Face's or GGUF).
    overwrite: replace an existing checkpoint at OUT (never the run or its base).
    """
    from llmkit.errors import InputError
    from llmkit.interop.checkpoint import read_meta, save_llmkit
    from llmkit.interop.load import load_model
    from llmkit.interop.peft import read_adapter_config
    from llmkit.outputs import building, claim
    from llmkit.runs import resolve_checkpoint

    path = resolve_checkpoint(run)
    adapters = (path / "adapter_config.json").is_file()
    meta = read_meta(path) if (path / "llmkit.json").is_file() else None
    if not adapters or (meta is not None and not meta.get("adapter")):
        raise InputError(f"{path} holds no LoRA adapters (train with lora.r > 0, or give a folder PEFT saved)")
    base = meta["adapter"]["base"] if meta is not None else read_adapter_config(path).get("base_model_name_or_path")
    output = claim(out, "checkpoint", inputs=[run, path, base], overwrite=overwrite)
    loaded = load_model(path)
    with building(output) as tmp:
        save_llmkit(
            loaded.model,
            tmp,
            tokenizer=loaded.tokenizer,
            hf_model_type=loaded.hf_model_type,
            hf_config=loaded.hf_config,
            generation_config=loaded.generation_config,
        )
    for note in loaded.notes:
        print(note)
    print(f"merged checkpoint: {out}")
    return 0


@dataclasses.dataclass(frozen=True)
class OwnText:
    """The model's own text a drafter learns from (graft-mtp and distill-draft): its greedy continuations of openings
    from the data, with its states and top-8 logits, computed once.

    sequences: how many continuations to learn from (the longest part: ~18 s per 16 for SmolLM2-135M on 2 cores).
    opening: tokens of each opening.
    new_tokens: tokens the model continues each opening with.
    writer: who writes the continuations: the model, or an int8 / int4 copy of it (faster, nearly the same text;
        the states and targets are always the model's own).
    work: where the collected text is kept (default OUT.text); a run that stops resumes from it, and graft-mtp and
        distill-draft can share it.
    """

    sequences: int = 800
    opening: int = 48
    new_tokens: int = 208
    writer: Literal["model", "int8", "int4"] = "int4"
    work: str | None = None


@dataclasses.dataclass(frozen=True)
class DrafterTraining:
    """How the drafter trains: `llmkit train`'s loop, in OUT.run with its checkpoints.

    minutes: the training time (the schedule is fitted to it).
    steps: train for this many steps instead of --minutes.
    precision: the training's autocast: fp32, bf16, or auto (bf16 where the device is fast at it).
    resume: continue the training run in OUT.run from its latest checkpoint.
    """

    minutes: float = 12.0
    steps: int | None = None
    precision: Literal["fp32", "bf16", "auto"] = "fp32"
    resume: bool = False


@dataclasses.dataclass(frozen=True)
class _Drafting:
    """What graft-mtp and distill-draft share: the model, the text it writes, and how the drafter trains."""

    checkpoint: str
    data: str
    text: OwnText
    training: DrafterTraining
    device: str | None
    overwrite: bool

    def claim(self, out: str) -> Output:
        """OUT, checked before any heavy work; and the settings, checked too."""
        from llmkit.errors import InputError

        text, training = self.text, self.training
        for name, value, ok, want in [
            ("--sequences", text.sequences, text.sequences >= 2, "at least 2"),
            ("--opening", text.opening, text.opening >= 1, "at least 1"),
            ("--new-tokens", text.new_tokens, text.new_tokens >= 2, "at least 2"),
            ("--minutes", training.minutes, training.minutes > 0, "positive"),
            ("--steps", training.steps, training.steps is None or training.steps >= 1, "at least 1"),
        ]:
            if not ok:
                raise InputError(f"{name} {value} is out of range: it must be {want}")
        return claim(out, "checkpoint", inputs=[self.checkpoint, self.data], overwrite=self.overwrite)

    def own_text(self, output: Output, check: Callable[[Any], object]) -> tuple[Any, Path]:
        """The model and the work folder holding its own text (train, held-out): its greedy continuations of
        openings from the data's train and val splits with its states and top-8 logits, collected into --work
        (default OUT.text; the command's own folder, where a rerun finds them) as a training data source
        (llmkit.train.own_text). check(model) refuses a model before any text is written."""
        import copy

        import torch

        from llmkit.cli.common import load_decoder
        from llmkit.errors import InputError
        from llmkit.models import DecoderLM
        from llmkit.quant import quantize
        from llmkit.tokenizer import Tokenizer
        from llmkit.train.data import TokenData
        from llmkit.train.own_text import collect_own_text
        from llmkit.train.source import check_same_tokenizer

        text = self.text
        text_dir = Path(text.work) if text.work is not None else Path(f"{output.path}.text")
        if overlaps(text_dir, output.path):
            raise InputError(f"--work {text_dir} would be replaced with OUT {output.path}: keep it beside OUT")
        claim(text_dir, "work", inputs=[self.checkpoint, self.data], owned=True)
        for leftover in text_dir.glob("*/*.tmp"):  # a part a killed collection left unfinished
            leftover.unlink()
        model, tokenizer = load_decoder(self.checkpoint, "fp32", self.device)
        check(model)
        tokens = TokenData(self.data)
        check_same_tokenizer(tokenizer, Tokenizer.from_dir(self.data), self.checkpoint, self.data)

        def openings(split: str, n: int) -> list[list[int]]:
            stream, length = tokens.split(split).tokens, text.opening
            if len(stream) < length + 1:
                raise InputError(
                    f"{self.data}'s {split} split holds {len(stream)} tokens: too few for {length}-token openings"
                )
            starts = torch.linspace(0, len(stream) - length - 1, n).long().tolist()
            return [[int(t) for t in stream[s : s + length]] for s in starts]

        writer = None if text.writer == "model" else cast(DecoderLM, quantize(copy.deepcopy(model), text.writer))
        for split, n in (("train", text.sequences), ("val", 32)):
            folder = text_dir / split
            collect_own_text(
                model, openings(split, n), folder, new_tokens=text.new_tokens, writer=writer, tokenizer=tokenizer
            )
        return model, text_dir

    def train(
        self,
        output: Output,
        text_dir: Path,
        model: dict[str, Any],
        *,
        batch: int,
        lr: float,
        loss: dict[str, Any] | None = None,
        trainable: list[str] | None = None,
    ) -> Any:
        """Train the drafter `model` (the config's model section) on the own text in `text_dir` with `llmkit train`'s
        loop, in OUT.run (its checkpoints, which --resume continues; a new run replaces an earlier one only with
        --overwrite): for --steps, or a schedule fitted to --minutes. AdamW without weight decay, 20 steps of
        warm-up, a cosine to zero, gradients clipped to norm 1."""
        import shutil

        from llmkit.errors import InputError
        from llmkit.outputs import found_at
        from llmkit.train.config import TrainConfig
        from llmkit.train.loop import train

        run, training = Path(f"{output.path}.run"), self.training
        if not training.resume and found_at(run) == "run":
            if not self.overwrite:
                raise InputError(f"{run} holds an earlier training run: continue it with --resume, or --overwrite")
            shutil.rmtree(run)
        timed = {"steps": 10**6, "time_limit": training.minutes * 60, "fit_to_time": True}
        seq_len = self.text.opening + self.text.new_tokens
        cfg = TrainConfig.from_dict(
            {
                "model": model,
                "data": {"dir": str(text_dir), "seq_len": seq_len, "batch_size": batch},
                "optim": {"lr": lr, "beta2": 0.999, "weight_decay": 0.0, "grad_clip": 1.0},
                "schedule": {"kind": "cosine", "warmup_steps": 20, "min_lr_ratio": 0.0},
                "loss": loss or {},
                "train": {
                    **(timed if training.steps is None else {"steps": training.steps}),
                    "trainable": trainable,
                    "device": self.device or "cpu",
                    "precision": training.precision,
                    "seed": 0,
                    "log_every": 25,
                    "eval_every": 10**6,  # the held-out estimate comes at the end
                    "save_every": 50,
                    "keep_last": 1,
                    "out": str(run),
                },
            }
        )
        return train(cfg, resume=training.resume)

    def load(self, result: Any) -> Any:
        """The trained drafter: the run's last checkpoint, in eval mode."""
        from llmkit.interop.load import load_model

        return load_model(result.checkpoint, device=self.device).model.eval()


def _finish(output: Output, drafter: Any, tokenizer_from: Path, report: Any) -> None:
    """OUT: the trained drafter as a plain llmkit checkpoint (with the tokenizer of its run's checkpoint), and the
    drafter's report."""
    import json

    from llmkit.interop.checkpoint import save_llmkit
    from llmkit.tokenizer import Tokenizer

    with building(output) as tmp:
        save_llmkit(drafter, tmp, tokenizer=Tokenizer.from_dir(tokenizer_from))
        (tmp / "drafter.json").write_text(json.dumps(dataclasses.asdict(report), indent=2))


def graft_mtp(
    checkpoint: str,
    out: str,
    *,
    data: str,
    unroll: int = 3,
    device: str | None = None,
    overwrite: bool = False,
    text: OwnText = OwnText(),
    training: DrafterTraining = DrafterTraining(),
) -> int:
    """Graft an MTP module onto a pretrained model and teach it to draft for the model (self-speculative decoding).

    The module learns what the model itself says: its greedy continuations of openings from the data, with its
    states and top-8 logits, computed once (the model stays frozen); then the module alone trains, EAGLE-style,
    also on its own outputs so that it drafts several tokens in a chain. Training is `llmkit train` on that text
    (model: {checkpoint: CHECKPOINT, mtp_depth: 1}, train.trainable: [mtp]), in OUT.run with its checkpoints.
    Decode with `llmkit generate OUT --mtp --speculate 3 --draft-head-bits 4`: the model's own output, in fewer
    passes.

    checkpoint: the pretrained model (an llmkit checkpoint or run, a Hugging Face folder, a GGUF file), float.
    out: where to write the model with its module (an llmkit checkpoint).
    data: a prepared token folder (llmkit prepare ... --tokenizer CHECKPOINT): openings from its train split, and
        held-out ones from its val split for the acceptance estimate.
    unroll: chain depth trained (and the k the estimate is for). A training step takes 16 sequences.
    device: cpu, cuda, cuda:1, ... (default: the CPU); the collected text is kept on the CPU either way.
    overwrite: replace an existing checkpoint at OUT (never the input), and an earlier run in OUT.run.
    """
    from llmkit.errors import InputError
    from llmkit.train.drafting import DrafterReport, evaluate_drafter
    from llmkit.train.own_text import read_own_text

    if not 1 <= unroll <= 8:
        raise InputError(f"--unroll {unroll} is out of range: it must be between 1 and 8")
    drafting = _Drafting(checkpoint, data, text, training, device, overwrite)
    output = drafting.claim(out)

    def no_modules(model: Any) -> None:
        if len(model.mtp):
            raise InputError(f"{checkpoint} already has MTP modules; give a model without")

    model, text_dir = drafting.own_text(output, no_modules)
    del model  # the run reads the checkpoint itself
    batch = min(16, text.sequences)
    spec = {"checkpoint": checkpoint, "mtp_depth": 1}
    loss = {"unroll": unroll}
    result = drafting.train(output, text_dir, spec, batch=batch, lr=2e-3, loss=loss, trainable=["mtp"])
    grafted = drafting.load(result)
    agree, accepted = evaluate_drafter(grafted, read_own_text(text_dir, "val"), unroll, text.opening)
    report = DrafterReport(result.steps, result.steps * batch, result.seconds, agree, accepted)
    _finish(output, grafted, result.checkpoint, report)
    shown = ", ".join(f"{a:.2f}" for a in report.agreement)
    print(
        f"drafter: {report.steps} steps over {report.sequences} sequences in {report.seconds:.0f} s; held out, depth "
        f"1..{unroll} agree with the model {shown}; a round of k={unroll} accepts {report.accepted_per_round:.2f}"
    )
    print(f"checkpoint: {out}  (llmkit generate {out} --mtp --speculate {unroll} --draft-head-bits 4)")
    return 0


def _kept_blocks(keep: str) -> Callable[[Any], list[int]]:
    """--keep "0,1,-1" -> the block indices it names in a model (negative counts from the last); a clear error for
    a list that is not numbers (at once) or that names blocks the model lacks or twice (once the model is read)."""
    from llmkit.errors import InputError

    try:
        blocks = [int(i) for i in keep.split(",")]
    except ValueError:
        raise InputError(f"--keep {keep!r} must be block numbers separated by commas, e.g. 0,1,2,3,-1") from None

    def chosen(model: Any) -> list[int]:
        n = model.cfg.n_layers
        out = [i + n if i < 0 else i for i in blocks]
        if len(set(out)) != len(out) or not all(0 <= i < n for i in out):
            raise InputError(
                f"--keep {keep} must name distinct blocks of the model's {n} (0..{n - 1}, or -1 for the last)"
            )
        return out

    return chosen


def distill_draft(
    checkpoint: str,
    out: str,
    *,
    data: str,
    keep: str = "0,1,2,3,-1",
    k: int = 3,
    device: str | None = None,
    overwrite: bool = False,
    text: OwnText = OwnText(),
    training: DrafterTraining = DrafterTraining(),
) -> int:
    """Make a draft model for speculative decoding out of a pretrained model: a few of its blocks (with its
    embedding, final norm and head), distilled on the model's own text (its continuations of openings from the
    data and its top-8 logits there, collected as `llmkit graft-mtp` does; the same --work folder serves both).
    Training is `llmkit train` on that text (model: {checkpoint: CHECKPOINT, keep_blocks: [...]}), in OUT.run with
    its checkpoints. Decode with `llmkit generate CHECKPOINT --draft OUT --speculate 3`, the draft best held in int8
    (`llmkit quantize OUT OUT-int8 --to int8 --include-head`); the output stays the model's own.

    checkpoint: the pretrained model (an llmkit checkpoint or run, a Hugging Face folder, a GGUF file), float.
    out: where to write the draft (an llmkit checkpoint).
    data: a prepared token folder (llmkit prepare ... --tokenizer CHECKPOINT).
    keep: the model's blocks the draft keeps, in order (negative counts from the last): the first few build the
        representation and the last is what the head reads.
    k: drafts a round, for the held-out acceptance estimate. A training step takes 8 sequences.
    device: cpu, cuda, cuda:1, ... (default: the CPU).
    overwrite: replace an existing checkpoint at OUT (never the input), and an earlier run in OUT.run.
    """
    from llmkit.errors import InputError
    from llmkit.train.drafting import DrafterReport, agreement
    from llmkit.train.own_text import read_own_text

    if not 1 <= k <= 8:
        raise InputError(f"--k {k} is out of range: it must be between 1 and 8")
    chosen = _kept_blocks(keep)
    drafting = _Drafting(checkpoint, data, text, training, device, overwrite)
    output = drafting.claim(out)
    model, text_dir = drafting.own_text(output, chosen)
    n, kept = model.cfg.n_layers, chosen(model)
    del model  # the run reads the checkpoint itself
    batch = min(8, text.sequences)
    spec = {"checkpoint": checkpoint, "keep_blocks": kept}
    result = drafting.train(output, text_dir, spec, batch=batch, lr=3e-4)
    draft = drafting.load(result)
    agree, accepted = agreement(draft, read_own_text(text_dir, "val"), k, text.opening)
    report = DrafterReport(result.steps, result.steps * batch, result.seconds, [agree], accepted)
    _finish(output, draft, result.checkpoint, report)
    print(
        f"draft: {draft.cfg.n_layers} of {n} blocks, {report.steps} steps over {report.sequences} sequences in "
        f"{report.seconds:.0f} s; held out, it agrees with the model {report.agreement[0]:.2f}; a round of k={k} "
        f"accepts {report.accepted_per_round:.2f}"
    )
    print(f"checkpoint: {out}  (llmkit generate {checkpoint} --draft {out} --speculate {k})")
    return 0
