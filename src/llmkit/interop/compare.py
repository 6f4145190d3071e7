"""`llmkit compare`: run the same input through transformers and through llmkit, layer by layer.

Both load the same checkpoint (a Hugging Face directory, or a GGUF file, which transformers dequantizes the same
way). Forward hooks capture every layer's output on both sides; the report gives, per layer, the largest absolute
difference and the cosine similarity of the hidden states over the real tokens, then the logits' largest absolute
difference and how often both pick the same top-1 token. A conversion that is right shows differences at fp32
rounding level everywhere; one that is wrong shows where it goes wrong.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from llmkit.errors import LLMKitError
from llmkit.interop.hf import TOKENIZER_FILES, family_for
from llmkit.interop.load import load_model
from llmkit.interop.loaded import Loaded

DEFAULT_PROMPT = "The Transformer replaced recurrence with attention, so every position is computed in parallel."


def _capture(layers: list[nn.Module], store: list[Tensor]) -> list[Any]:
    def hook(_module: nn.Module, _args: Any, out: Any) -> None:
        store.append((out[0] if isinstance(out, tuple) else out).detach().float())

    return [layer.register_forward_hook(hook) for layer in layers]


def _ids(loaded: Loaded, hf_tokenizer: Any, prompt: str, vocab: int) -> tuple[list[int], str]:
    if loaded.tokenizer is not None:
        return loaded.tokenizer.encode(prompt), "llmkit tokenizer"
    if hf_tokenizer is not None:
        return list(hf_tokenizer(prompt, add_special_tokens=False).input_ids), "transformers tokenizer"
    # no tokenizer: a deterministic id sequence from the prompt's bytes, so the comparison still runs
    return [b % vocab for b in prompt.encode("utf-8")], "prompt bytes (no tokenizer found)"


def _reference(transformers: Any, loaded: Loaded, auto_class: str) -> tuple[Any, Any]:
    """transformers' model for the same checkpoint, and its tokenizer when llmkit found none."""
    kwargs: dict[str, Any] = {}
    directory = loaded.path
    if loaded.source == "gguf":  # transformers reads a GGUF file from its directory
        kwargs["gguf_file"] = loaded.path.name
        directory = loaded.path.parent
    ref = getattr(transformers, auto_class).from_pretrained(str(directory), dtype=torch.float32, **kwargs).eval()
    tokenizer = None
    has_files = loaded.source == "gguf" or any((directory / f).is_file() for f in TOKENIZER_FILES)
    if loaded.tokenizer is None and has_files:
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory), **kwargs)
        except Exception:
            tokenizer = None
    return ref, tokenizer


def compare(path: str | os.PathLike[str], prompt: str | None = None) -> dict[str, Any]:
    """Compare llmkit with transformers on a checkpoint; returns the report as a dict.

    The checkpoint's family says which transformers Auto class loads it, where that model keeps its layer stacks
    and how one input runs through both; llmkit's model gives its own stacks (`layer_stacks()`), in the same order."""
    try:
        import transformers
    except ImportError:
        raise LLMKitError("llmkit compare needs transformers: pip install transformers") from None
    p = Path(path)
    loaded = load_model(p, dtype=torch.float32)
    ours = loaded.model.eval()
    layer_stacks = getattr(ours, "layer_stacks", None)
    if layer_stacks is None:
        raise LLMKitError(
            f"llmkit compare lines up Transformer layers with transformers'; this {type(ours).__name__} has no "
            "layer stacks to compare"
        )
    if loaded.source == "llmkit":
        raise LLMKitError(f"{p} is an llmkit checkpoint; compare needs the Hugging Face directory or GGUF file")
    model_type = loaded.hf_model_type or "llama"
    family = family_for(model_type)
    ref, hf_tokenizer = _reference(transformers, loaded, family.auto_class)
    ids, tokenized_by = _ids(loaded, hf_tokenizer, prompt or DEFAULT_PROMPT, ours.cfg.vocab_size)
    if not ids:
        raise LLMKitError("the prompt gives no tokens; give a non-empty --prompt")
    if max(ids) >= ours.cfg.vocab_size:
        raise LLMKitError(
            f"the {tokenized_by} gives id {max(ids)}, outside the model's vocabulary of {ours.cfg.vocab_size}: "
            "the tokenizer files do not belong to this model"
        )
    inputs = family.one_input(torch.tensor([ids]), loaded.hf_config or {})

    stacks: dict[str, nn.ModuleList] = layer_stacks()
    names = [f"{stack}.{i}" for stack, layers in stacks.items() for i in range(len(layers))]
    our_layers = [layer for layers in stacks.values() for layer in layers]
    ref_layers = [layer for path_ in family.reference_stacks for layer in ref.get_submodule(path_).children()]
    ref_states: list[Tensor] = []
    our_states: list[Tensor] = []
    handles = _capture(ref_layers, ref_states) + _capture(our_layers, our_states)
    try:
        with torch.no_grad():
            ref_logits = ref(**inputs.theirs).logits.float()
            our_logits = ours(*inputs.ours).float()
    finally:
        for h in handles:
            h.remove()
    layers = [
        {
            "layer": name,
            "max_abs_diff": float((a - b).abs().max()),
            "cosine": float(F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0)),
        }
        for name, a, b in zip(names, our_states, ref_states, strict=True)
    ]
    return {
        "path": str(p),
        "source": loaded.source,
        "model_type": model_type,
        "n_tokens": len(ids),
        "tokenized_by": tokenized_by,
        "layers": layers,
        "logits_max_abs_diff": float((our_logits - ref_logits).abs().max()),
        "logits_max_abs": float(ref_logits.abs().max()),
        "top1_agreement": float((our_logits.argmax(-1) == ref_logits.argmax(-1)).float().mean()),
    }


def format_compare_report(r: dict[str, Any]) -> str:
    lines = [
        f"{r['path']} ({r['source']}, {r['model_type']}): {r['n_tokens']} tokens ({r['tokenized_by']})",
        f"  {'layer':<12} {'max |diff|':>12} {'cosine':>12}",
    ]
    for row in r["layers"]:
        lines.append(f"  {row['layer']:<12} {row['max_abs_diff']:>12.3e} {row['cosine']:>12.8f}")
    lines.append(f"  logits max |diff| {r['logits_max_abs_diff']:.3e} (largest logit {r['logits_max_abs']:.2f})")
    lines.append(f"  top-1 agreement   {100 * r['top1_agreement']:.1f}%")
    return "\n".join(lines)
