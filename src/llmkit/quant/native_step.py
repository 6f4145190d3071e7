"""Decoding steps whose blocks run in one C++ call (llmkit/quant/cpu_decode.cpp) on x86 CPUs with AVX2.

A decode step feeds one token per row through every block. In PyTorch each block is about twenty small operations,
and at batch 1 their dispatch costs more than their arithmetic: SmolLM2-135M (30 blocks) spent ~12 ms of a 22 ms
int4 step calling operators. `NativeDecoder` runs the step's blocks in one call instead (per block: norm, q/k/v in
one pass, RoPE, the cache write, attention over the visible slots, output projection, residual, norm, the
feed-forward in two passes, residual; the threads started once per step), reading the model's own parameters and
caches: nothing is copied or converted, and the module tree is untouched. Everything else in the step (embedding,
RoPE tables, the final norm, sampling) stays in PyTorch; an fp32 output head of a few rows runs in C++ too
(`logits`: MKL reads SmolLM2's 113 MB head at a third of the bandwidth for one row, and twice for two).

It applies to the common pre-norm decoder (GPT-2, LLaMA, Mistral, Qwen2, Qwen3, SmolLM2: RMSNorm or LayerNorm,
grouped-query attention with or without RoPE, a sliding window and QK-norm, SwiGLU/GeGLU or a plain MLP), and to its
mixture-of-experts form (Mixtral, Qwen2-MoE, Qwen3-MoE, GLM-4.5's DeepSeek-V3 router behind grouped-query
attention: every router of moe.py without a capacity factor, shared experts, gated or not; cpu_moe.cpp), in fp32
on the CPU, with linear layers and expert stacks that are fp32 or llmkit's int4/int8 (quantized with
`llmkit.quant.quantize` or kept from a GGUF file); and to steps of a few new tokens per row (one when decoding; a
speculative round's drafts when verifying, up to MAX_TOKENS) into a plain KVCache, or of one new token per row into
the serving engine's paged pools. Anything else (MLA, sparse attention, Gemma's offset norms, bf16, CUDA, training,
prefill) takes the PyTorch modules, which remain the reference: tests/quant/test_native_decode.py checks that both
give the same logits.

What the step computes is declared per module type in LOWERED (lowering.py): every attribute, parameter, buffer
and submodule of a lowered module, with the values the C++ step computes. A module holding anything else (an option
added to a layer later) is not lowered, and the model decodes in PyTorch; tests/quant/test_native_lowering.py builds
each layer with each option and checks that the step matches PyTorch or declines.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor, nn

from llmkit.layers.attention.cache import KVCache
from llmkit.layers.attention.gqa import GroupedQueryAttention
from llmkit.layers.mlp import MLP, SwiGLU
from llmkit.layers.moe import MoE
from llmkit.layers.norm import LayerNorm, RMSNorm
from llmkit.layers.softcap import soft_cap
from llmkit.models import DecoderLM, Step
from llmkit.quant import native
from llmkit.quant.block_linear import BlockLinear
from llmkit.quant.experts import QuantizedExperts
from llmkit.quant.linear import Int4Linear, Int8Linear, QuantizedLinear
from llmkit.quant.lowering import ACTIVATION_CODES, lowers

MAX_TOKENS = 8  # new tokens per row a step may bring: every weight is read once for all of them
GIVEN_TOKENS = 256  # the same for given tokens (a prompt's) in the batch-invariant mode, multiplied in panels
HEAD_ROWS = 8  # rows of states the C++ head takes; beyond, MKL's sgemm is as fast (it reads W once per 4 rows)


def _projection(ext: Any, layer: nn.Module) -> Any | None:
    """A linear layer as the C++ step reads it, or None when it cannot (a kernel other than llmkit's AVX2 one)."""
    bias = getattr(layer, "bias", None)
    bias = None if bias is None else bias.detach()
    if type(layer) is nn.Linear:
        w = layer.weight.detach()
        if w.dtype != torch.float32 or w.device.type != "cpu" or not w.is_contiguous():
            return None
        return ext.Projection(0, w, bias=bias)
    if isinstance(layer, Int4Linear) and layer.resolved == "avx2":
        return ext.Projection(1, layer.qweight, layer.scales, layer.zeros, bias)
    if isinstance(layer, Int8Linear) and layer.resolved == "avx2":
        return ext.Projection(2, layer.qweight, layer.scales, None, bias)
    if isinstance(layer, BlockLinear) and layer.resolved == "avx2":
        return ext.Projection(layer.blocks, layer.block.ggml, layer.in_features, bias)
    return None


def _stack(ext: Any, weight: Tensor | QuantizedLinear | None) -> Any | None:
    """Stacked expert weights (E, out, in) as one (E out, in) matrix the C++ step reads: fp32, or the codes of a
    QuantizedExperts stack when llmkit's AVX2 kernel takes their group size. None when it cannot."""
    if weight is None:
        return None
    if isinstance(weight, QuantizedLinear):
        try:
            if isinstance(weight, Int4Linear):
                return ext.Projection(1, weight.qweight, weight.scales, weight.zeros, None)
            return ext.Projection(2, weight.qweight, weight.scales, None, None)
        except RuntimeError:  # a group size the kernel does not take
            return None
    w = weight.detach()
    if w.dtype != torch.float32 or w.device.type != "cpu" or not w.is_contiguous():
        return None
    return ext.Projection(0, w.view(-1, w.shape[-1]))


def _moe(ext: Any, moe: MoE) -> Any | None:
    """A lowered mixture-of-experts feed-forward as cpu_moe.cpp computes it, or None when some weight is not one it
    reads (not fp32 nor llmkit's codes) or a shared expert is of another kind than the routed ones."""
    cfg, experts = moe.cfg, moe.experts
    router = moe.router.weight.detach()
    if router.dtype != torch.float32:
        return None
    f = ext.MoEFeedForward()
    f.router = router.contiguous()
    f.score_bias = None if moe.router.score_bias is None else moe.router.score_bias.detach().float().contiguous()
    f.softmax = cfg.score_func == "softmax"
    f.top_k, f.n_groups, f.topk_groups = cfg.top_k, cfg.n_groups, cfg.topk_groups
    f.group_max, f.norm_topk, f.routed_scale = cfg.group_score == "max", cfg.norm_topk, cfg.routed_scale
    f.activation = ACTIVATION_CODES[experts.activation]
    stacks: list[Tensor | QuantizedLinear | None]
    if isinstance(experts, QuantizedExperts):
        stacks = [experts.q1, experts.q3, experts.q2]
    else:
        stacks = [experts.w1, experts.w3, experts.w2]
    f.gated = stacks[1] is not None
    w1, w3, w2 = (_stack(ext, w) for w in stacks)
    if w1 is None or w2 is None or (f.gated and w3 is None):
        return None
    f.w1, f.w2 = w1, w2
    if f.gated:
        f.w3 = w3
    if moe.shared is not None:
        shared = cast(MLP | SwiGLU, moe.shared)
        if type(shared) is not (SwiGLU if f.gated else MLP) or shared.activation != experts.activation:
            return None
        parts = [_projection(ext, shared.w1), _projection(ext, shared.w3) if isinstance(shared, SwiGLU) else None]
        parts.append(_projection(ext, shared.w2))
        if parts[0] is None or parts[2] is None or (f.gated and parts[1] is None):
            return None
        f.s1, f.s2 = parts[0], parts[2]
        if f.gated:
            f.s3 = parts[1]
    if moe.shared_gate is not None:
        gate = moe.shared_gate.weight.detach()
        if gate.dtype != torch.float32 or moe.shared_gate.bias is not None:
            return None
        f.shared_gate = gate.reshape(-1).contiguous()
    return f


def _block(ext: Any, block: nn.Module, rope: bool) -> Any | None:
    """The C++ step of one block, or None when it does not compute all of it."""
    if not lowers(block):
        return None
    attn = cast(GroupedQueryAttention, block.attn)
    norm1, norm2 = (
        cast(RMSNorm | LayerNorm, block.attn_residual.norm),
        cast(RMSNorm | LayerNorm, block.ffn_residual.norm),
    )
    if type(norm1) is not type(norm2) or norm1.eps != norm2.eps:
        return None  # one kind of norm and one eps per block in C++
    b = ext.DecodeBlock()
    b.rms, b.eps = type(norm1) is RMSNorm, norm1.eps
    b.norm1_weight, b.norm1_bias = norm1.weight.detach(), _detached(getattr(norm1, "bias", None))
    b.norm2_weight, b.norm2_bias = norm2.weight.detach(), _detached(getattr(norm2, "bias", None))
    b.n_heads, b.n_kv_heads, b.head_dim, b.v_head_dim = attn.n_heads, attn.n_kv_heads, attn.head_dim, attn.head_dim
    b.rope_dim = attn.rope_dim if rope else 0
    b.rope_interleaved = attn.rope_layout == "interleaved"
    b.window = attn.sliding_window or 0
    b.scale = attn.scale
    if attn.q_norm is not None:
        q_norm, k_norm = cast(RMSNorm, attn.q_norm), cast(RMSNorm, attn.k_norm)
        b.q_norm_weight, b.k_norm_weight, b.qk_eps = q_norm.weight.detach(), k_norm.weight.detach(), q_norm.eps
    layers: dict[str, nn.Module] = {"wq": attn.wq, "wk": attn.wk, "wv": attn.wv, "wo": attn.wo}
    ffn = block.ffn
    if isinstance(ffn, MoE):
        moe = _moe(ext, ffn)
        if moe is None:
            return None
        b.moe = moe
    else:
        dense = cast(MLP | SwiGLU, ffn)
        b.gated, b.activation = isinstance(dense, SwiGLU), ACTIVATION_CODES[dense.activation]
        layers |= {"w1": dense.w1, "w2": dense.w2, **({"w3": dense.w3} if isinstance(dense, SwiGLU) else {})}
    for name, layer in layers.items():
        p = _projection(ext, layer)
        if p is None:
            return None
        setattr(b, name, p)
    b.check()
    return b


def _detached(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.detach()


class NativeDecoder:
    """The C++ decode step of every block of `model` (build it with `of`, which says None where it does not apply).
    Holds references to the model's tensors: build it again after replacing modules (quantizing, loading into new
    modules); in-place updates of the weights are seen."""

    def __init__(self, model: DecoderLM, ext: Any, blocks: list[Any]) -> None:
        self.model, self.ext, self.blocks = model, ext, blocks

    @classmethod
    def of(cls, model: nn.Module) -> NativeDecoder | None:
        """The C++ step of `model`, or None when it does not compute every block (see LOWERED) or the weights are
        not fp32 on the CPU."""
        ext = native.module()
        if ext is None or not isinstance(model, DecoderLM) or not lowers(model):
            return None
        if model.device.type != "cpu" or model.dtype != torch.float32:
            return None
        blocks = [_block(ext, block, model.rope is not None) for block in model.blocks]
        if any(b is None for b in blocks):
            return None
        return cls(model, ext, blocks)

    def applies(self, tokens: Tensor, step: Step, layers: list[Any], most: int = MAX_TOKENS) -> bool:
        """Whether this step is one the C++ blocks take: 1 to `most` new tokens per row into fp32 KVCaches."""
        first = layers[0] if layers else None
        allowed = step.mask.allowed
        return (
            1 <= tokens.shape[1] <= most
            and type(first) is KVCache
            and first.k.dtype == torch.float32
            and first.k.is_contiguous()
            and step.slots is not None
            and allowed is not None
            and tuple(allowed.shape) == (tokens.shape[0], 1, 1, first.k.shape[2])
            and step.mask.window is None
            and not torch.is_grad_enabled()
        )

    def run(self, tokens: Tensor, step: Step, layers: list[Any], given: bool = False) -> Tensor:
        """The blocks over tokens (B, T) at `step` (its T consecutive slots), writing into the caches: what
        `model.run` computes. `given`: the tokens are given (a prompt's), not generated: their products are integer
        panels where the weights are GGUF blocks and the CPU has AVX512-VNNI (see `run_tokens`). Returns the last
        block's output (B, T, C)."""
        model = self.model
        x = model.inputs(model.embed, tokens, step.positions)  # (B, T, C)
        return self.run_blocks(self.blocks, x, step, layers, given)

    def block(self, block: nn.Module) -> Any | None:
        """The C++ step of another block reading this model's positions (an MTP module's), or None."""
        return _block(self.ext, block, self.model.rope is not None)

    def run_blocks(self, blocks: list[Any], x: Tensor, step: Step, layers: list[Any], given: bool = False) -> Tensor:
        """C++ blocks (the model's, or `block`'s) over states x (B, T, C) at `step`, writing into their caches
        `layers` (`given`: as `run`'s). Returns the last block's output (B, T, C)."""
        assert step.mask.allowed is not None and step.slots is not None
        (B, T, C), S = x.shape, layers[0].k.shape[2]
        cos, sin = self._rope(step.positions)
        ks, vs = [c.k for c in layers], [c.v for c in layers]
        allowed, slot = step.mask.allowed.reshape(B, S), int(step.slots[0])
        flat = x.reshape(B * T, C).contiguous()
        return self.ext.decode(blocks, flat, ks, vs, slot, allowed, cos, sin, 0 if given else -1).view(B, T, C)

    def logits(self, h: Tensor, invariant: bool = False) -> Tensor:
        """The model's head on final-normed states h (..., C) -> logits (..., V): `model.logits`, through the C++
        product when the head is an fp32 matrix and h has at most HEAD_ROWS rows. `invariant`: every row gets the
        same bits whatever the rows beside it (the C++ product for any number of rows; a quantized head in pieces of
        fewer rows than its AVX2 kernel's switch to fp32 panels)."""
        model, rows = self.model, h.reshape(-1, h.shape[-1])
        # the type first: a quantized head's `weight` is a property that dequantizes the whole matrix
        plain = model.head is None or (type(model.head) is nn.Linear and model.head.bias is None)
        if invariant and not plain:
            head = model.head
            choice = head.kernel_choice if isinstance(head, QuantizedLinear) else native.default_choice()
            pieces = rows.split(choice.integer_rows)
            return torch.cat([model.logits(p) for p in pieces]).view(*h.shape[:-1], -1)
        if not plain or (rows.shape[0] > HEAD_ROWS and not invariant):
            return model.logits(h)
        weight: Tensor = model.embed.weight if model.head is None else cast(Tensor, model.head.weight)
        if weight.dtype != torch.float32:
            return model.logits(h)
        out = self.ext.float_linear(rows.contiguous(), weight.contiguous(), model.head_bias)
        return soft_cap(out.view(*h.shape[:-1], -1), model.cfg.logit_softcap)

    def applies_paged(self, new_tokens: int, keys: list[Tensor]) -> bool:
        """Whether the serving engine's step over paged pools (llmkit.serve.paged) is one the C++ blocks take:
        one new token per row, and every layer's keys (K, N, bs, D) contiguous fp32 (or int8 codes, whose scales
        run_paged and run_tokens are given)."""
        return (
            new_tokens == 1
            and len(keys) == len(self.blocks)
            and all(k.dtype in (torch.float32, torch.int8) and k.is_contiguous() for k in keys)
            and not torch.is_grad_enabled()
        )

    def run_paged(
        self,
        tokens: Tensor,
        *,
        positions: Tensor,
        table: Tensor,
        slots: Tensor,
        allowed: Tensor,
        keys: list[Tensor],
        values: list[Tensor],
        scales: tuple[list[Tensor], list[Tensor]] | None = None,
        adapters: Any | None = None,
    ) -> Tensor:
        """The blocks over tokens (B, 1) at `positions` (B, 1), row b's new token into its logical slot slots[b]
        (B,) of each layer's pool of keys and values (K, N, bs, D) through block table (B, nb); allowed
        (B, nb * bs): the slots each row may see; `scales`: int8 pools' key and value scales (K, N, bs);
        `adapters`: the rows' LoRA adapters (llmkit.serve.adapters.LowRankStep). What the engine's `model.run`
        over the pools' views computes; returns the last block's output (B, 1, C)."""
        B = tokens.shape[0]
        model = self.model
        x = model.inputs(model.embed, tokens, positions).reshape(B, -1).contiguous()  # (B, C)
        cos, sin = self._rope(positions)
        k_scales, v_scales = scales or (None, None)
        out = self.ext.decode_paged(self.blocks, x, keys, values, table, slots, allowed, cos, sin, -1, k_scales,
                                    v_scales, *_low_rank(adapters))  # fmt: skip
        return out.view(B, 1, -1)

    def run_tokens(
        self,
        tokens: Tensor,
        *,
        positions: Tensor,
        table: Tensor,
        allowed: Tensor,
        keys: list[Tensor],
        values: list[Tensor],
        given_from: int | None = None,
        scales: tuple[list[Tensor], list[Tensor]] | None = None,
        adapters: Any | None = None,
    ) -> Tensor:
        """The blocks over N tokens (N,) of any sequences, each its own row: token i at position positions[i]
        (which is its logical slot) through block table row table[i] (N, nb), seeing the slots allowed[i] (N, S) up
        to its own. Several consecutive tokens of one sequence (a prompt's chunk) share a table row: all keys and
        values are written before any token attends, so each sees the ones before it. Every token then goes through
        the arithmetic of a decoding row (the serving engine's batch-invariant mode), except that the tokens from
        `given_from` on (given ones: a prompt's) are multiplied in integer panels where the weights are GGUF blocks
        and the CPU has AVX512-VNNI: the panels beat the decoding kernels 1.5-12x at many rows, and give a row its
        own bits too, other ones than the decoding kernels'. `scales`, `adapters` (each token's): as run_paged's.
        Returns (N, C)."""
        model = self.model
        x = model.inputs(model.embed, tokens[:, None], positions[:, None])[:, 0].contiguous()  # (N, C)
        cos, sin = self._rope(positions[:, None])
        given = -1 if given_from is None else given_from
        k_scales, v_scales = scales or (None, None)
        return self.ext.decode_paged(self.blocks, x, keys, values, table, positions, allowed, cos, sin, given,
                                     k_scales, v_scales, *_low_rank(adapters))  # fmt: skip

    def _rope(self, positions: Tensor) -> tuple[Tensor | None, Tensor | None]:
        """The RoPE tables of positions (B, T): cos and sin (1 | B T, F) (None without RoPE)."""
        if self.model.rope is None:
            return None, None
        rope = self.model.rope(positions)
        return rope.cos.reshape(-1, rope.cos.shape[-1]), rope.sin.reshape(-1, rope.sin.shape[-1])


def _low_rank(adapters: Any | None) -> tuple[Any, Any, Tensor | None]:
    """decode_paged's lora_a, lora_b and adapter_rows for a LowRankStep (llmkit.serve.adapters), or none."""
    if adapters is None:
        return None, None, None
    return adapters.a, adapters.b, adapters.which.to(torch.long).contiguous()
