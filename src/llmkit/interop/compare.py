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
from llmkit.interop.checkpoint import Loaded, load_model
from llmkit.models import EncoderDecoder, RNNSeq2Seq

DEFAULT_PROMPT = "The Transformer replaced recurrence with attention, so every position is computed in parallel."

# where each side keeps its layer stacks: Hugging Face module paths (by model_type) and llmkit's
_HF_LAYERS = {
    "gpt2": ("transformer.h",),
    "marian": ("model.encoder.layers", "model.decoder.layers"),
}
_HF_DEFAULT = ("model.layers",)


def _get(module: nn.Module, path: str) -> nn.Module:
    for part in path.split("."):
        module = getattr(module, part)
    return module


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


def compare(path: str | os.PathLike[str], prompt: str | None = None) -> dict[str, Any]:
    """Compare llmkit with transformers on a checkpoint; returns the report as a dict."""
    try:
        import transformers
    except ImportError:
        raise LLMKitError("llmkit compare needs transformers: pip install transformers") from None
    p = Path(path)
    loaded = load_model(p, dtype=torch.float32)
    ours = loaded.model.eval()
    kwargs: dict[str, Any] = {"dtype": torch.float32}
    directory = p
    if loaded.source == "gguf":
        kwargs["gguf_file"] = p.name
        directory = p.parent
    elif loaded.source != "hf":
        raise LLMKitError(f"{p} is an llmkit checkpoint; compare needs the Hugging Face directory or GGUF file")
    auto = transformers.AutoModelForSeq2SeqLM if isinstance(ours, EncoderDecoder) else transformers.AutoModelForCausalLM
    ref = auto.from_pretrained(str(directory), **kwargs).eval()
    hf_tokenizer = None
    from llmkit.interop.hf import TOKENIZER_FILES

    has_files = loaded.source == "gguf" or any((directory / f).is_file() for f in TOKENIZER_FILES)
    if loaded.tokenizer is None and has_files:
        try:
            hf_tokenizer = transformers.AutoTokenizer.from_pretrained(
                str(directory), **{k: v for k, v in kwargs.items() if k == "gguf_file"}
            )
        except Exception:
            hf_tokenizer = None
    ids, tokenized_by = _ids(loaded, hf_tokenizer, prompt or DEFAULT_PROMPT, ours.cfg.vocab_size)
    if not ids:
        raise LLMKitError("the prompt gives no tokens; give a non-empty --prompt")
    if max(ids) >= ours.cfg.vocab_size:
        raise LLMKitError(
            f"the {tokenized_by} gives id {max(ids)}, outside the model's vocabulary of {ours.cfg.vocab_size}: "
            "the tokenizer files do not belong to this model"
        )
    tokens = torch.tensor([ids])

    ref_states: list[Tensor] = []
    our_states: list[Tensor] = []
    model_type = loaded.hf_model_type or "llama"
    ref_layers = [m for path_ in _HF_LAYERS.get(model_type, _HF_DEFAULT) for m in _get(ref, path_).children()]
    if isinstance(ours, RNNSeq2Seq):
        raise LLMKitError("llmkit compare checks Transformer models against transformers; this is an RNN")
    our_layers = list(ours.encoder) + list(ours.decoder) if isinstance(ours, EncoderDecoder) else list(ours.blocks)
    handles = _capture(ref_layers, ref_states) + _capture(our_layers, our_states)
    try:
        with torch.no_grad():
            if isinstance(ours, EncoderDecoder):
                start = int((loaded.hf_config or {}).get("decoder_start_token_id") or 0)
                target = torch.cat([torch.tensor([[start]]), tokens[:, :-1]], dim=1)
                ref_logits = ref(input_ids=tokens, decoder_input_ids=target).logits.float()
                our_logits = ours(tokens, target).float()
            else:
                ref_logits = ref(input_ids=tokens).logits.float()
                our_logits = ours(tokens).float()
    finally:
        for h in handles:
            h.remove()
    names = [f"encoder.{i}" for i in range(len(ours.encoder))] + [f"decoder.{i}" for i in range(len(ours.decoder))] \
        if isinstance(ours, EncoderDecoder) else [f"layer.{i}" for i in range(len(our_layers))]  # fmt: skip
    layers = []
    for name, a, b in zip(names, our_states, ref_states, strict=True):
        layers.append(
            {
                "layer": name,
                "max_abs_diff": float((a - b).abs().max()),
                "cosine": float(F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0)),
            }
        )
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
