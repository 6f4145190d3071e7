"""The `-tiny` sibling of every preset: the same mechanisms (attention kind and head ratios, windows, RoPE scaling,
experts and their groups, an encoder) at toy sizes: vocabulary 256, d_model 64, 2-3 layers, context 256."""

from __future__ import annotations

import dataclasses

from llmkit.config import AttentionConfig, EncoderConfig, IndexerConfig, MLAConfig, ModelConfig


def tiny_config(cfg: ModelConfig) -> ModelConfig:
    """`cfg`'s mechanisms at toy sizes: its tiny sibling."""
    a, p = cfg.attention, cfg.position
    tiny_attention: AttentionConfig
    if a.kind == "gqa":
        ratio = a.n_heads // cfg.n_kv_heads  # keep MHA as MHA and GQA as GQA
        heads = 8 if ratio >= 2 else 4
        kv = None if a.n_kv_heads is None else max(1, heads // ratio)
        head_dim = None if a.head_dim is None else 16  # a head width of its own stays one, at a toy size
        window = None if a.sliding_window is None else 16  # a window shorter than the tests' sequences
        tiny_attention = dataclasses.replace(a, n_heads=heads, n_kv_heads=kv, head_dim=head_dim, sliding_window=window)
    else:
        assert a.mla is not None
        mla = MLAConfig(
            kv_lora_rank=32,
            q_lora_rank=None if a.mla.q_lora_rank is None else 48,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
        )
        indexer = None if a.indexer is None else IndexerConfig(n_heads=4, head_dim=16, topk=8)
        tiny_attention = dataclasses.replace(a, n_heads=4, mla=mla, indexer=indexer)
    scaling = p.scaling
    if scaling is not None and scaling.original_max_seq_len is not None:
        scaling = dataclasses.replace(scaling, factor=4.0, original_max_seq_len=64)
    moe = cfg.moe
    if moe is not None:
        grouped = moe.n_groups > 1
        moe = dataclasses.replace(
            moe,
            n_experts=16 if grouped else 8,
            top_k=min(moe.top_k, 4 if grouped else 2),
            expert_hidden_dim=32,
            n_groups=4 if grouped else 1,
            topk_groups=2 if grouped else 1,
            first_dense_layers=min(moe.first_dense_layers, 1),
        )
    encoder = None if cfg.encoder is None else EncoderConfig(n_layers=2)
    return dataclasses.replace(
        cfg,
        vocab_size=256,
        d_model=64,
        n_layers=3 if moe is not None and moe.first_dense_layers else 2,
        attention=tiny_attention,
        ffn=dataclasses.replace(cfg.ffn, hidden_dim=128 if cfg.ffn.kind == "mlp" else 96),
        position=dataclasses.replace(p, max_seq_len=256, scaling=scaling),
        moe=moe,
        encoder=encoder,
    )
