"""What several commands share: the --dtype choices, loading a model to generate with, printing a stream."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Literal

from llmkit.errors import LLMKitError

if TYPE_CHECKING:
    import torch

    from llmkit.models import DecoderLM
    from llmkit.tokenizer import Tokenizer

DType = Literal["fp32", "bf16", "fp16"]

_TORCH_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def invariance(required: bool, off: bool) -> bool | None:
    """The batch-invariant mode from --batch-invariant (`required`) and --no-batch-invariant (`off`): True, False,
    or None (the default: wherever the C++ step runs)."""
    if required and off:
        raise LLMKitError("--batch-invariant and --no-batch-invariant contradict each other: give one")
    return True if required else False if off else None


def torch_dtype(name: DType | None) -> torch.dtype | None:
    """The torch dtype a --dtype flag names; None (keep the checkpoint's) when it is not given."""
    import torch

    return getattr(torch, _TORCH_NAMES[name]) if name else None


def print_streamed(
    tok: Tokenizer, steps: Iterable[list[int | None]], *, prompt: Sequence[int] = (), end_id: int | None = None
) -> list[int]:
    """Print the first row's new tokens as `stream` yields them, each character once it is complete, then a newline;
    returns the tokens. The row ends when it finishes or yields `end_id`, which is not printed. The text follows
    `prompt`'s (already printed), as it would in decode(prompt + tokens)."""
    from llmkit.tokenizer import IncrementalDecoder

    decoder = IncrementalDecoder(tok, prompt)
    tokens: list[int] = []
    for step in steps:
        token = step[0]
        if token is None or token == end_id:
            break
        tokens.append(token)
        print(decoder.push(token), end="", flush=True)
    print(decoder.finish(), flush=True)
    return tokens


def load_decoder(
    checkpoint: str, dtype: DType | None, device: str | None = None, verify: bool = True, split: bool = False
) -> tuple[DecoderLM, Tokenizer]:
    """A decoder-only model, in eval mode, and its tokenizer; a run folder gives its latest checkpoint. `split`:
    this tensor-parallel rank's part of it, only that read from the files (torch.distributed initialized)."""
    from llmkit.interop.load import load_model
    from llmkit.machine.devices import check_device
    from llmkit.models import DecoderLM
    from llmkit.runs import resolve_checkpoint

    if device is not None:
        check_device(device)
    path = resolve_checkpoint(checkpoint, averaged=False)
    cut = None
    if split:
        from llmkit.parallel import split_loader

        cut = split_loader()
    loaded = load_model(path, dtype=torch_dtype(dtype), device=device, verify=verify, split=cut, own_width=True)
    if loaded.tokenizer is None:
        raise LLMKitError(f"{checkpoint} has no tokenizer to turn text into tokens")
    if not isinstance(loaded.model, DecoderLM):
        raise LLMKitError(f"{checkpoint} is an encoder-decoder model; `llmkit generate` continues decoder-only models")
    loaded.model.eval()
    from llmkit.quant import describe, parameter_count

    print(
        f"loaded {checkpoint} ({loaded.source}){_part(loaded.model)}: {parameter_count(loaded.model) / 1e6:.1f}M "
        "parameters, "
        f"{describe(loaded.model)}" + "".join(f"; {n}" for n in loaded.notes),
        file=sys.stderr,
        flush=True,
    )
    return loaded.model, loaded.tokenizer


def _part(model: DecoderLM) -> str:
    tp = getattr(model, "tensor_parallel", None)
    return "" if tp is None else f", rank {tp.rank}'s part of {tp.world}"
