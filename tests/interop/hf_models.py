"""Tiny random Hugging Face models of every supported family, built offline from configs."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = __import__("pytest").importorskip("transformers")

SMALL = dict(
    vocab_size=96,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=80,
    max_position_embeddings=256,
)
DEEPSEEK = dict(
    vocab_size=96,
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    intermediate_size=80,
    moe_intermediate_size=24,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=8,
    max_position_embeddings=256,
    routed_scaling_factor=2.5,
)
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 0.8,
    "mscale_all_dim": 0.8,
    "rope_theta": 10000.0,
}
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
    "rope_theta": 500000.0,
}


def _builders() -> dict[str, Any]:
    T = transformers
    return {
        "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(**SMALL, num_key_value_heads=2, rope_parameters=LLAMA3)),
        "llama-tied": lambda: T.LlamaForCausalLM(
            T.LlamaConfig(**SMALL, num_key_value_heads=4, tie_word_embeddings=True, attention_bias=True)
        ),
        "mistral": lambda: T.MistralForCausalLM(T.MistralConfig(**SMALL, num_key_value_heads=1, sliding_window=5)),
        "mistral-wide": lambda: T.MistralForCausalLM(
            T.MistralConfig(**SMALL, num_key_value_heads=2, sliding_window=64)
        ),
        "qwen2": lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**SMALL, num_key_value_heads=2, tie_word_embeddings=True)),
        "qwen3": lambda: T.Qwen3ForCausalLM(T.Qwen3Config(**SMALL, num_key_value_heads=2, head_dim=32)),
        "qwen2_moe": lambda: T.Qwen2MoeForCausalLM(
            T.Qwen2MoeConfig(
                **SMALL,
                num_key_value_heads=2,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=24,
                shared_expert_intermediate_size=48,
                mlp_only_layers=[0],
            )
        ),
        "qwen3_moe": lambda: T.Qwen3MoeForCausalLM(
            T.Qwen3MoeConfig(
                **SMALL,
                num_key_value_heads=2,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=24,
                norm_topk_prob=True,
            )
        ),
        "gemma": lambda: T.GemmaForCausalLM(T.GemmaConfig(**SMALL, num_key_value_heads=1, head_dim=32)),
        "gemma2": lambda: T.Gemma2ForCausalLM(
            T.Gemma2Config(
                **SMALL,
                num_key_value_heads=2,
                head_dim=16,
                query_pre_attn_scalar=24,
                sliding_window=5,
                attn_logit_softcapping=2.0,
                final_logit_softcapping=3.0,
            )
        ),
        "gemma3_text": lambda: T.Gemma3ForCausalLM(
            T.Gemma3TextConfig(
                **{**SMALL, "num_hidden_layers": 3},
                num_key_value_heads=2,
                head_dim=16,
                query_pre_attn_scalar=24,
                sliding_window=5,
                sliding_window_pattern=3,
                rope_parameters={
                    "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                },
            )
        ),
        "phi3": lambda: T.Phi3ForCausalLM(
            T.Phi3Config(
                **SMALL,
                num_key_value_heads=2,
                pad_token_id=0,
                eos_token_id=1,
                sliding_window=64,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75},
            )
        ),
        "starcoder2": lambda: T.Starcoder2ForCausalLM(
            T.Starcoder2Config(**SMALL, num_key_value_heads=2, bos_token_id=0, eos_token_id=0)
        ),
        "stablelm": lambda: T.StableLmForCausalLM(
            T.StableLmConfig(
                **SMALL,
                num_key_value_heads=2,
                use_qkv_bias=True,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
            )
        ),
        "glm4_moe": lambda: T.Glm4MoeForCausalLM(
            T.Glm4MoeConfig(
                **SMALL,
                num_key_value_heads=2,
                attention_bias=True,
                use_qk_norm=True,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
                moe_intermediate_size=24,
                n_routed_experts=8,
                num_experts_per_tok=2,
                n_shared_experts=1,
                n_group=4,
                topk_group=2,
                first_k_dense_replace=1,
                routed_scaling_factor=2.5,
            )
        ),
        "dots1": lambda: T.Dots1ForCausalLM(
            T.Dots1Config(
                **SMALL,
                num_key_value_heads=2,
                moe_intermediate_size=24,
                n_routed_experts=8,
                num_experts_per_tok=2,
                n_shared_experts=2,
                first_k_dense_replace=1,
                norm_topk_prob=True,
                max_window_layers=2,
            )
        ),
        "mixtral": lambda: T.MixtralForCausalLM(
            T.MixtralConfig(**SMALL, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
        ),
        "gpt2": lambda: T.GPT2LMHeadModel(
            T.GPT2Config(vocab_size=96, n_embd=64, n_layer=2, n_head=4, n_positions=256, bos_token_id=0, eos_token_id=0)
        ),
        "deepseek_v3": lambda: T.DeepseekV3ForCausalLM(T.DeepseekV3Config(**DEEPSEEK, rope_parameters=YARN)),
        "deepseek_v3-nolora": lambda: T.DeepseekV3ForCausalLM(
            T.DeepseekV3Config(
                **{**DEEPSEEK, "q_lora_rank": None, "n_group": 1, "topk_group": 1, "n_shared_experts": 2}
            )
        ),
        "deepseek_v2": lambda: T.DeepseekV2ForCausalLM(
            T.DeepseekV2Config(**DEEPSEEK, topk_method="group_limited_greedy", n_shared_experts=1, rope_parameters=YARN)
        ),
        "deepseek_v2-greedy": lambda: T.DeepseekV2ForCausalLM(
            T.DeepseekV2Config(**{**DEEPSEEK, "q_lora_rank": None, "n_group": None, "topk_group": None})
        ),
        "deepseek_v32": lambda: T.DeepseekV32ForCausalLM(
            T.DeepseekV32Config(**DEEPSEEK, index_n_heads=8, index_head_dim=8, index_topk=4)
        ),
        "marian": lambda: T.MarianMTModel(
            T.MarianConfig(
                vocab_size=96,
                d_model=64,
                encoder_layers=2,
                decoder_layers=2,
                encoder_attention_heads=4,
                decoder_attention_heads=4,
                encoder_ffn_dim=80,
                decoder_ffn_dim=80,
                max_position_embeddings=256,
                pad_token_id=0,
                decoder_start_token_id=0,
                eos_token_id=1,
                scale_embedding=True,
                activation_function="swish",
            )
        ),
    }


NAMES = list(_builders())
DECODERS = [n for n in NAMES if n != "marian"]


def build_hf(name: str, directory: Path) -> Path:
    """Build the named tiny model with non-trivial weights, save it, return its directory."""
    torch.manual_seed(0)
    model = _builders()[name]()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n and n.endswith("weight"):
                p.uniform_(0.5, 1.5)  # norm gains that are not all 1 catch a misplaced norm
            elif n.endswith("e_score_correction_bias"):
                p.normal_(0, 0.05)
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.normal_(0, 0.05)
            if n.endswith("final_logits_bias"):
                b.normal_(0, 0.5)
    d = directory / name
    model.save_pretrained(d)
    return d


def reference(directory: Path) -> Any:
    """transformers' model for a checkpoint directory, loaded by the Auto class its family names."""
    from llmkit.interop.hf import family_for, read_config

    auto = getattr(transformers, family_for(read_config(directory)["model_type"]).auto_class)
    return auto.from_pretrained(str(directory), dtype=torch.float32).eval()
