"""`llmkit prepare preferences FILE.jsonl --checkpoint CK`: pairs of answers to one prompt, one preferred, made ready
for preference optimisation (train/preference.py): token ids, the answer tokens a model is scored on, and the
reference model's log-probabilities of each answer, computed once here so that training holds one model.

Each line of the input holds a prompt and two answers, in either of the forms TRL's DPOTrainer reads:

    conversational  {"prompt": [{"role": "user", "content": "..."}], "chosen": [{"role": "assistant", ...}],
                     "rejected": [{"role": "assistant", ...}]}
                    rendered with the checkpoint's chat template, as `prepare chat` renders a conversation: an
                    answer's tokens are what the assistant says, with its end-of-turn marker
    standard        {"prompt": "2 + 2 =", "chosen": " 4", "rejected": " 5"}: the prompt and the answer as plain text,
                    the answer's tokens followed by the tokenizer's end-of-sequence token

The answer's tokens are those that start inside it (chat.encode_example); the prompt's tokens are the same in both
sequences of a pair only as far as the tokenizer keeps them so, which is why each sequence is scored on its own.

    OUT/tokenizer.json, tokenizer_config.json    the checkpoint's tokenizer and chat template
    OUT/{split}_tokens.bin, _targets.bin,        as chat.py's layout: sequence 2k is pair k's prompt and chosen
        _offsets.bin                             answer, sequence 2k + 1 its prompt and rejected answer
    OUT/{split}_reference.bin                    float64 (pairs, 2): the summed log-probabilities of the chosen and
                                                 the rejected answer's tokens under the checkpoint, in fp32
    OUT/meta.json                                format "llmkit-preferences", counts per split, and the reference:
                                                 the checkpoint's path and fingerprint (training checks that it
                                                 starts from the same weights)

The reference is the checkpoint as training loads it: float weights (a GGUF file dequantized), or quantized ones (an
llmkit quantized checkpoint, or a GGUF file's with `quantized`): the frozen base of QLoRA (lora.quantized), which the
run checks.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmkit.data.arrays import META, token_dtype, write_array
from llmkit.data.chat import (
    ROLES,
    ChatData,
    ChatSplit,
    _in_val,
    assistant_spans,
    check_messages,
    common_meta,
    row_arrays,
    write_split,
)
from llmkit.errors import ConfigError, InputError
from llmkit.outputs import building, claim
from llmkit.tokenizer import Tokenizer

FORMAT = "llmkit-preferences"
SIDES = ("chosen", "rejected")

Prompt = list[dict[str, str]] | str


def is_preferences(path: str | os.PathLike[str]) -> bool:
    """Whether a prepared data folder holds preference pairs."""
    meta = Path(path) / META
    return meta.is_file() and json.loads(meta.read_text()).get("format") == FORMAT


def _messages(value: object, where: str, field: str, roles: tuple[str, ...]) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise InputError(f"{where}: {field!r} must be a non-empty list of messages (or, for all three, a string)")
    return check_messages(value, where, field, roles)


def parse_pair(line: str, where: str) -> tuple[Prompt, Prompt, Prompt]:
    """(prompt, chosen, rejected) of one JSON line, checked: three strings, or three lists of messages whose answers
    are the assistant's."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise InputError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict) or any(k not in obj for k in ("prompt", *SIDES)):
        raise InputError(f'{where}: expected an object with "prompt", "chosen" and "rejected"')
    prompt, chosen, rejected = obj["prompt"], obj["chosen"], obj["rejected"]
    if all(isinstance(v, str) for v in (prompt, chosen, rejected)):
        if not chosen or not rejected:
            raise InputError(f"{where}: an empty answer gives nothing to compare")
        return prompt, chosen, rejected
    if any(isinstance(v, str) for v in (prompt, chosen, rejected)):
        raise InputError(f"{where}: prompt, chosen and rejected must all be strings or all be lists of messages")
    return (
        _messages(prompt, where, "prompt", ROLES),
        _messages(chosen, where, "chosen", ("assistant",)),
        _messages(rejected, where, "rejected", ("assistant",)),
    )


def encode_answer(tokenizer: Tokenizer, prompt: Prompt, answer: Prompt) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, target flags) of the prompt followed by one answer: the flags mark the answer's tokens (a prompt's
    own assistant turns are context)."""
    closing: list[int] = []  # a plain-text answer ends with the end-of-sequence token, a target too
    if isinstance(prompt, list):
        assert isinstance(answer, list)
        text, spans = assistant_spans(tokenizer, prompt + answer)
        spans = spans[sum(m["role"] == "assistant" for m in prompt) :]
    else:
        assert isinstance(answer, str)
        if tokenizer.eos_id is None:
            raise ConfigError("the tokenizer has no end-of-sequence token to close a plain-text answer with")
        text, spans, closing = prompt + answer, [(len(prompt), len(prompt) + len(answer))], [tokenizer.eos_id]
    enc = tokenizer.backend.encode(text, add_special_tokens=False)
    starts = np.array([a for a, _ in enc.offsets], dtype=np.int64)
    flags = np.zeros(len(enc.ids), dtype=np.uint8)
    for a, b in spans:
        flags[(starts >= a) & (starts < b)] = 1
    ids = np.asarray(enc.ids + closing, dtype=np.int64)
    targets = np.concatenate([flags, np.ones(len(closing), dtype=np.uint8)])
    return ids, targets


def fingerprint(path: str | os.PathLike[str]) -> str:
    """What identifies a checkpoint's weights: "sha256:<hex>" over the digests of its weight, config and tokenizer
    files (a GGUF file: its own digest), each read from its stamp while the file is unchanged."""
    import hashlib

    from llmkit.interop.checkpoint import file_digest
    from llmkit.interop.stamps import stamped_digest

    p = Path(path)
    suffixes = (".safetensors", ".gguf", ".json", ".jinja")
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in suffixes)
    h = hashlib.sha256()
    for f in files:
        name = f.name if p.is_file() else f.relative_to(p).as_posix()
        h.update(f"{name}\0{stamped_digest(f, file_digest)}\n".encode())
    return f"sha256:{h.hexdigest()}"


def reference_logps(
    model: torch.nn.Module, split: ChatSplit, pad_id: int, device: torch.device, batch_tokens: int = 8192
) -> np.ndarray:
    """The summed log-probability of every sequence's target tokens under `model`, in fp32 (float64 (sequences,)):
    sequences sorted by length and batched up to `batch_tokens` padded tokens, one a row, as training reads them."""
    from llmkit.models.loss import answer_logps

    lengths = split.lengths()
    order = np.argsort(lengths, kind="stable")[::-1]
    out = np.zeros(len(split), dtype=np.float64)
    model.eval()
    at = 0
    with torch.no_grad():
        while at < len(order):
            width = int(lengths[order[at]]) - 1
            rows = max(1, batch_tokens // max(width, 1))
            chunk = order[at : at + rows]
            x, y, _ = row_arrays(split, [[int(k)] for k in chunk], width, pad_id)
            logits = model(torch.from_numpy(x).to(device))
            logps, _ = answer_logps(logits, torch.from_numpy(y).to(device))
            out[chunk] = logps.double().cpu().numpy()
            at += len(chunk)
    return out


Parts = dict[str, dict[str, list[np.ndarray]]]  # split -> "ids" / "targets" -> one array a sequence


def read_pairs(path: Path, tok: Tokenizer, max_tokens: int, val_fraction: float, progress: bool) -> tuple[Parts, int]:
    """The encoded sequences of a .jsonl file of pairs by split (chosen then rejected, pair after pair), and how
    many pairs were left out for being longer than `max_tokens`."""
    from tqdm import tqdm

    parts: Parts = {s: {"ids": [], "targets": []} for s in ("train", "val")}
    too_long = 0
    with path.open(encoding="utf-8") as f:
        lines = f.readlines()
    for n, line in enumerate(tqdm(lines, desc="encode pairs", unit="pair", disable=not progress), start=1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        prompt, chosen, rejected = parse_pair(line, where)
        if isinstance(prompt, list) and not tok.chat_template:
            raise ConfigError(f"{where}: the tokenizer has no chat template to render conversational pairs with")
        encoded = [encode_answer(tok, prompt, answer) for answer in (chosen, rejected)]
        for side, (_, targets) in zip(SIDES, encoded, strict=True):
            if not targets[1:].any():
                raise InputError(f"{where}: the {side} answer has no tokens after the prompt's first")
        if max(len(ids) for ids, _ in encoded) > max_tokens:
            too_long += 1
            continue
        part = parts["val" if _in_val(line.strip(), val_fraction) else "train"]
        for ids, targets in encoded:
            part["ids"].append(ids)
            part["targets"].append(targets)
    if not parts["train"]["ids"]:
        longer = f" ({too_long} longer than max_tokens={max_tokens})" if too_long else ""
        raise InputError(f"{path} holds no training pairs{longer}")
    return parts, too_long


def write_pairs(
    out_dir: Path, name: str, part: dict[str, list[np.ndarray]], tok: Tokenizer, reference: tuple[Any, Any] | None
) -> dict[str, Any]:
    """One split's arrays in `out_dir` (chat.py's layout) and, with `reference` = (model, device), its reference
    log-probabilities; returns its entry of meta.json."""
    written = write_split(out_dir, name, part["ids"], part["targets"], token_dtype(tok.vocab_size))
    files = dict(written.meta["files"])
    if reference is not None:
        model, device = reference
        split = ChatSplit(written.ids, written.targets, written.offsets, 0)
        logps = reference_logps(model, split, int(tok.eos_id or 0), device) if len(split) else np.zeros(0)
        files["reference"] = f"{name}_reference.bin"
        write_array(logps.reshape(-1, 2), out_dir / files["reference"])
    return {**written.meta, "files": files, "pairs": written.meta["examples"] // 2, "target_chars": 0}


def prepare_preferences(
    source: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    checkpoint: str | os.PathLike[str],
    quantized: bool = False,
    reference: bool = True,
    max_tokens: int = 2048,
    val_fraction: float = 0.05,
    device: str = "auto",
    progress: bool = True,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Prepare a .jsonl file of preference pairs into `out` with `checkpoint`'s tokenizer and chat template, and (with
    `reference`) its log-probabilities of every answer; returns the metadata written to meta.json. Pairs with a
    sequence longer than `max_tokens` are left out (and counted). `out` is built beside itself and renamed into
    place when complete (an existing data folder is replaced only with `overwrite`; never a checkpoint or an input)."""
    from llmkit.interop.load import load_model
    from llmkit.models import DecoderLM
    from llmkit.quant import quantized_spec
    from llmkit.runs import resolve_checkpoint

    if not 0.0 <= val_fraction < 1.0:
        raise InputError(f"val_fraction={val_fraction} must be in [0, 1)")
    if max_tokens < 2:
        raise InputError(f"max_tokens={max_tokens} must be at least 2")
    path = Path(source)
    if not path.is_file():
        raise InputError(f"{path} does not exist (expected a .jsonl file of preference pairs)")
    ckpt = resolve_checkpoint(str(checkpoint))
    output = claim(out, "data", inputs=[source, ckpt], overwrite=overwrite)
    start = time.time()
    loaded = load_model(ckpt, dtype=torch.float32, quantized=quantized)
    tok, model = loaded.tokenizer, loaded.model
    if tok is None:
        raise ConfigError(f"{ckpt} has no tokenizer to read the pairs with")
    if not isinstance(model, DecoderLM):
        raise ConfigError(f"{ckpt} is not a decoder-only language model")
    held_quantized = quantized_spec(model) is not None  # what training must load it as: lora.quantized or not
    parts, too_long = read_pairs(path, tok, max_tokens, val_fraction, progress)
    run_on = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    scorer = (model.to(run_on), run_on) if reference else None
    with building(output) as out_dir:
        tok.save(out_dir)
        splits = {name: write_pairs(out_dir, name, part, tok, scorer) for name, part in parts.items()}
        about = {"checkpoint": str(Path(ckpt).resolve()), "fingerprint": fingerprint(ckpt), "quantized": held_quantized}
        meta = {
            **common_meta(FORMAT, source, tok, val_fraction),
            "max_tokens": max_tokens,
            "left_out": too_long,
            "reference": about if reference else None,
            "splits": splits,
        }
        (out_dir / META).write_text(json.dumps(meta, indent=2) + "\n")
    meta["seconds"] = time.time() - start
    return meta


class PreferenceData(ChatData):
    """A prepared preference folder, memory-mapped: the chat layout (sequence 2k chosen, 2k + 1 rejected) and the
    reference log-probabilities of each split ((pairs, 2) float64), when they were computed."""

    format = FORMAT

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(path)
        self.reference: dict[str, np.ndarray] = {}
        for name, info in self.meta["splits"].items():
            if "reference" not in info["files"]:
                continue
            file = self.dir / info["files"]["reference"]
            if not file.is_file():
                raise InputError(f"{file} is missing: the data folder is incomplete, run `llmkit prepare` again")
            logps = np.fromfile(file, dtype=np.float64).reshape(-1, 2)
            if len(logps) != info["pairs"]:
                raise InputError(f"{file} does not match {META}; run `llmkit prepare` again")
            self.reference[name] = logps
