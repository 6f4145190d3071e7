"""Training checkpoints that survive anything: written atomically, the last K kept, resumed exactly.

    OUT/checkpoints/step-000500/       an llmkit checkpoint (llmkit.json, model.safetensors, tokenizer) that
                                       `llmkit generate` and `llmkit convert` read directly, plus
        trainer_state.pt               optimizer, step, tokens seen, RNG states (torch, CUDA, Python, NumPy)
        trainer_state.json             the same step and counters, readable
    OUT/checkpoints/latest             the name of the newest complete checkpoint

A checkpoint is written into a temporary folder (step-000500.tmp) and renamed into place only when complete, and
`latest` is replaced atomically afterwards: a crash at any moment leaves the previous checkpoint as the latest,
intact. A save that fails (a full disk) removes its temporary folder at once, and the next start of training removes
any a killed run left (`remove_leftovers`): otherwise a full disk would stay full and the resume fail as well.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmkit.config import ModelConfig
from llmkit.errors import LLMKitError
from llmkit.interop.checkpoint import (
    file_digest,
    load_llmkit,
    read_meta,
    save_llmkit,
    save_llmkit_adapter,
    verify_manifest,
)
from llmkit.interop.safetensors_io import CheckpointError
from llmkit.models import DecoderLM, EncoderDecoder, RNNConfig, RNNSeq2Seq
from llmkit.outputs import publish, recover, torch_save
from llmkit.runs import LATEST, TRAINER_STATE, TRAINER_STATE_JSON, checkpoint_dir, run_checkpoints
from llmkit.tokenizer import Tokenizer


class ResumeError(LLMKitError, ValueError):
    """A checkpoint cannot resume this run (another config, a damaged file, nothing to resume)."""


@dataclass
class TrainState:
    step: int  # optimizer steps completed
    tokens: int  # training tokens seen, all processes
    elapsed: float  # training seconds so far
    planned_steps: int = 0  # the schedule's length once train.fit_to_time fixed it (0: train.steps)


def _plain(x: Any) -> Any:
    """NumPy arrays inside nested dicts -> tagged lists (so torch.load(weights_only=True) can read them back)."""
    if isinstance(x, np.ndarray):
        return {"__ndarray__": x.tolist(), "dtype": str(x.dtype)}
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x


def _arrays(x: Any) -> Any:
    if isinstance(x, dict) and "__ndarray__" in x:
        return np.asarray(x["__ndarray__"], dtype=x["dtype"])
    if isinstance(x, dict):
        return {k: _arrays(v) for k, v in x.items()}
    return x


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": _plain(np.random.get_state(legacy=False)),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_tuples(state["python"]))
    np.random.set_state(_arrays(state["numpy"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _tuples(x: Any) -> Any:
    return tuple(_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x


def save(
    out: Path,
    model: DecoderLM | EncoderDecoder | RNNSeq2Seq,
    model_state: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any],
    state: TrainState,
    keep_last: int,
    tokenizer: Tokenizer | None,
    train_config: dict[str, Any],
    source_tokenizer: Tokenizer | None = None,
    generation_config: dict[str, Any] | None = None,
    adapter: dict[str, Any] | None = None,
) -> Path:
    """Write the checkpoint of `state.step` atomically and drop all but the newest `keep_last`. With `adapter`
    ({"base": PATH, "quantized": bool}), `model_state` holds LoRA adapters only, saved in PEFT's layout."""
    root = checkpoint_dir(out)
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{state.step:06d}"
    tmp = root / (name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        _write(tmp, model, model_state, tokenizer, source_tokenizer, generation_config, adapter)
        blob = {"optimizer": optimizer_state, "rng": rng_state(), "state": state.__dict__, "config": train_config}
        torch_save(blob, tmp / TRAINER_STATE)
        readable = {**state.__dict__, "model": model.cfg.to_dict(), "checksum": file_digest(tmp / TRAINER_STATE)}
        (tmp / TRAINER_STATE_JSON).write_text(json.dumps(readable, indent=2) + "\n")
        final = root / name
        publish(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # what a failed save wrote would keep a full disk full
        raise
    pointer = root / (LATEST + ".tmp")
    pointer.write_text(name + "\n")
    pointer.replace(root / LATEST)
    for old in run_checkpoints(out)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _write(
    tmp: Path,
    model: DecoderLM | EncoderDecoder | RNNSeq2Seq,
    model_state: dict[str, torch.Tensor],
    tokenizer: Tokenizer | None,
    source_tokenizer: Tokenizer | None,
    generation_config: dict[str, Any] | None,
    adapter: dict[str, Any] | None,
) -> None:
    """The llmkit checkpoint part: the model's weights, or its LoRA adapters in PEFT's layout."""
    if adapter is not None:
        assert isinstance(model.cfg, ModelConfig)
        save_llmkit_adapter(
            model,
            model.cfg,
            tmp,
            base=adapter["base"],
            quantized=adapter["quantized"],
            tokenizer=tokenizer,
            generation_config=generation_config,
            state=model_state,
        )
    else:
        save_llmkit(
            _StateHolder(model, model_state),
            tmp,
            tokenizer=tokenizer,
            source_tokenizer=source_tokenizer,
            generation_config=generation_config,
        )


def remove_leftovers(out: str | Path) -> list[str]:
    """Remove what an interrupted save left in a run's checkpoints folder (unfinished step-*.tmp folders, a
    latest.tmp; a step folder set aside while being replaced comes back if its replacement never arrived);
    returns what was done, to be reported. Called when training starts, before a resume looks for its checkpoint."""
    root = checkpoint_dir(out)
    if not root.is_dir():
        return []
    done = []
    for tmp in [*sorted(root.glob("step-*.tmp")), root / (LATEST + ".tmp")]:
        if tmp.is_dir():
            shutil.rmtree(tmp)
        elif tmp.exists():
            tmp.unlink()
        else:
            continue
        done.append(f"removed {tmp}, left by an interrupted checkpoint save")
    for old in sorted(root.glob("step-*.old-*")):
        if old.exists():  # recovering an earlier one may have handled this one
            done.extend(recover(old.with_name(old.name.partition(".old-")[0])))
    return done


class _StateHolder:
    """What save_llmkit needs of a model (its config and state dict), for a state dict gathered from shards."""

    def __init__(self, model: DecoderLM | EncoderDecoder | RNNSeq2Seq, state: dict[str, torch.Tensor]) -> None:
        self.cfg = model.cfg
        self._state = state

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self._state


@dataclass
class Resumed:
    model_state: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    rng: dict[str, Any]
    state: TrainState
    path: Path


def load(path: Path, expected: ModelConfig | RNNConfig) -> Resumed:
    """Read a training checkpoint for a run whose model config is `expected` (a LoRA run's: its adapters only)."""
    try:
        if read_meta(path).get("adapter"):
            from llmkit.interop.peft import read_peft

            verify_manifest(path)
            cfg = ModelConfig.from_dict(read_meta(path)["config"])
            model_state = read_peft(path, cfg)[1]
        else:
            model = load_llmkit(path).model
            cfg, model_state = model.cfg, dict(model.state_dict())
    except CheckpointError as e:
        raise ResumeError(f"cannot resume from {path}: {e}") from None
    if cfg.architecture() != expected.architecture():
        diff = _first_difference(_plain_architecture(cfg), _plain_architecture(expected))
        raise ResumeError(
            f"cannot resume from {path}: it was trained with a different model config ({diff}); start a new run "
            "(another train.out) or restore the original config"
        )
    _verify_trainer_state(path)
    try:
        blob = torch.load(path / TRAINER_STATE, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ResumeError(f"cannot resume from {path}: {TRAINER_STATE} is damaged ({type(e).__name__}: {e})") from None
    return Resumed(
        model_state,
        blob["optimizer"],
        blob["rng"],
        TrainState(**{k: v for k, v in blob["state"].items() if k in TrainState.__dataclass_fields__}),
        path,
    )


def _verify_trainer_state(path: Path) -> None:
    """A ResumeError unless trainer_state.json can be read and trainer_state.pt's bytes match the checksum it
    recorded: a state that cannot be checked is not loaded (a damaged moment would surface steps later as a
    diverging loss)."""
    readable = path / TRAINER_STATE_JSON
    try:
        recorded = json.loads(readable.read_text(encoding="utf-8"))["checksum"]
        if not isinstance(recorded, str):
            raise TypeError("'checksum' is not a string")
    except FileNotFoundError:
        raise ResumeError(
            f"cannot resume from {path}: {readable} is missing, so the checksum of {TRAINER_STATE} cannot be checked; "
            "remove this checkpoint folder to resume from the one before"
        ) from None
    except (ValueError, KeyError, TypeError) as e:
        raise ResumeError(
            f"cannot resume from {path}: {readable} cannot be read ({type(e).__name__}: {e}), so the checksum of "
            f"{TRAINER_STATE} cannot be checked; remove this checkpoint folder to resume from the one before"
        ) from None
    if not (path / TRAINER_STATE).is_file() or file_digest(path / TRAINER_STATE) != recorded:
        raise ResumeError(
            f"cannot resume from {path}: {TRAINER_STATE} is damaged (its SHA-256 differs from the one recorded in "
            f"{TRAINER_STATE_JSON}); resume from an earlier checkpoint by removing this one"
        )


def _plain_architecture(cfg: ModelConfig | RNNConfig) -> dict[str, Any]:
    arch = cfg.architecture()
    return arch if isinstance(arch, dict) else arch.to_dict()


def _first_difference(a: Any, b: Any, prefix: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                return _first_difference(a.get(k), b.get(k), f"{prefix}{k}.")
    return f"{prefix.rstrip('.')}: checkpoint {a!r}, config {b!r}"
