"""Marian (MarianMTModel): the original encoder-decoder Transformer as Helsinki-NLP's OPUS-MT models ship it.

    model.shared.weight (source, target, head)        embed.weight  (tie_word_embeddings, shared embeddings)
    model.encoder.layers.{i}.self_attn.{q,k,v,out}_proj    encoder.{i}.attn.{wq,wk,wv,wo}
    model.encoder.layers.{i}.self_attn_layer_norm          encoder.{i}.attn_residual.norm   (post-norm)
    model.encoder.layers.{i}.fc1 / fc2 / final_layer_norm  encoder.{i}.ffn.w1 / w2 / ffn_residual.norm
    model.decoder.layers.{i}.self_attn / encoder_attn      decoder.{i}.attn / cross
    model.decoder.layers.{i}.encoder_attn_layer_norm       decoder.{i}.cross_residual.norm
    final_logits_bias (1, V)                               head_bias (V,)

Positions are sinusoids with all sines first (llmkit's "half" layout), recomputed rather than stored.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor

from llmkit.config import ModelConfig
from llmkit.errors import ConfigError
from llmkit.interop.hf.activations import activation_field
from llmkit.interop.hf.base import Family, OneInput
from llmkit.interop.hf.fields import Assumed, Custom, Entry, Field, HFConfig, Stated, fixed, require
from llmkit.interop.keymap import Reshape, Rule


def _vocabularies_from_hf(hf: HFConfig, names: Collection[str]) -> dict[str, Any]:
    """One vocabulary and one embedding matrix for source and target (share_encoder_decoder_embeddings, the OPUS-MT
    default), or a source vocabulary (vocab_size) apart from the target one (decoder_vocab_size)."""
    vocab = int(require(hf, "vocab_size"))
    shared = bool(hf.get("share_encoder_decoder_embeddings", True))
    target = int(hf.get("decoder_vocab_size") or vocab)
    if shared and target != vocab:
        raise ConfigError("config.json shares embeddings but gives different source and target vocabularies")
    return {"vocab_size": target, "encoder.vocab_size": None if shared else vocab}


def _vocabularies_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    assert cfg.encoder is not None  # read by the encoder.n_layers field first
    return {
        "vocab_size": cfg.encoder.vocab_size or cfg.vocab_size,
        "decoder_vocab_size": cfg.vocab_size,
        "share_encoder_decoder_embeddings": cfg.encoder.vocab_size is None,
    }


FIELDS: tuple[Entry, ...] = (
    Field("d_model", "d_model", int),
    Field("n_layers", "decoder_layers", int),
    Field("encoder.n_layers", "encoder_layers", int),
    Custom(_vocabularies_from_hf, _vocabularies_to_hf),
    Field("attention.n_heads", ("encoder_attention_heads", "decoder_attention_heads"), int),
    Field("ffn.hidden_dim", ("encoder_ffn_dim", "decoder_ffn_dim"), int),
    Field("attention.dropout", "attention_dropout", float, 0.0),
    activation_field("ffn.activation", "activation_function", "marian", "silu"),
    Field("position.max_seq_len", "max_position_embeddings", int, 512),
    Field("tie_embeddings", "tie_word_embeddings", bool, True),
    Field("scale_embeddings", "scale_embedding", bool, False),
    Field("dropout", "dropout", float, 0.0),
    *fixed(
        "Marian is a post-norm encoder-decoder (LayerNorms with PyTorch's default eps) with sine-first sinusoidal "
        "positions, biased multi-head attention, a biased MLP and a logits bias",
        {
            "attention.kind": "gqa",
            "attention.qkv_bias": True,
            "attention.out_bias": True,
            "ffn.kind": "mlp",
            "ffn.bias": True,
            "moe": None,
            "position.kind": "sinusoidal",
            "position.layout": "half",
            "norm.kind": "layernorm",
            "norm.placement": "post",
            "norm.bias": True,
            "norm.eps": 1e-5,
            "head_bias": True,
        },
    ),
    Assumed("init", "xavier"),  # Marian's (and the paper's) Glorot-uniform initialisation
    Stated("is_encoder_decoder", True, "Marian is an encoder-decoder"),
)


def _attention(theirs: str, ours: str, where: str) -> list[Rule]:
    return [
        Rule(f"{ours}{a}.{p}", f"{theirs}{b}.{p}", where=where)
        for a, b in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "out_proj"))
        for p in ("weight", "bias")
    ]


def _linear(theirs: str, ours: str, where: str) -> list[Rule]:
    """A weight and its bias (a LayerNorm or a Linear)."""
    return [Rule(f"{ours}.{p}", f"{theirs}.{p}", where=where) for p in ("weight", "bias")]


def _stack_rules(theirs: str, ours: str, where: str) -> list[Rule]:
    """One encoder or decoder layer: self-attention and feed-forward sublayers, each with its post-norm."""
    return [
        *_attention(theirs + "self_attn.", ours + "attn.", where),
        *_linear(theirs + "self_attn_layer_norm", ours + "attn_residual.norm", where),
        *_linear(theirs + "fc1", ours + "ffn.w1", where),
        *_linear(theirs + "fc2", ours + "ffn.w2", where),
        *_linear(theirs + "final_layer_norm", ours + "ffn_residual.norm", where),
    ]


class MarianFamily(Family):
    name = "marian"
    model_types: ClassVar[tuple[str, ...]] = ("marian",)
    architectures: ClassVar[dict[str, str]] = {"marian": "MarianMTModel"}
    fields = FIELDS
    auto_class = "AutoModelForSeq2SeqLM"
    reference_stacks: ClassVar[tuple[str, ...]] = ("model.encoder.layers", "model.decoder.layers")

    def rules(self, cfg: ModelConfig, names: Collection[str]) -> list[Rule]:
        enc, dec = "model.encoder.layers.{i}.", "model.decoder.layers.{i}."
        rules = [
            *_stack_rules(enc, "encoder.{i}.", "encoder"),
            *_stack_rules(dec, "decoder.{i}.", "decoder"),
            *_attention(dec + "encoder_attn.", "decoder.{i}.cross.", "decoder"),
            *_linear(dec + "encoder_attn_layer_norm", "decoder.{i}.cross_residual.norm", "decoder"),
            Rule("head_bias", "final_logits_bias", Reshape((1, cfg.vocab_size))),
        ]
        assert cfg.encoder is not None
        if cfg.encoder.vocab_size is None:
            rules.append(Rule("embed.weight", "model.shared.weight"))
        else:
            rules += [
                Rule("src_embed.weight", "model.encoder.embed_tokens.weight"),
                Rule("embed.weight", "model.decoder.embed_tokens.weight"),
            ]
        if not cfg.tie_embeddings:
            rules.append(Rule("head.weight", "lm_head.weight"))
        return rules

    def ignored(self, name: str, cfg: ModelConfig) -> bool:
        if name.endswith("embed_positions.weight"):  # sinusoids, recomputed
            return True
        assert cfg.encoder is not None
        shared = cfg.encoder.vocab_size is None
        tied_copies = ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight") if shared else ()
        return name in tied_copies or super().ignored(name, cfg)

    def one_input(self, tokens: Tensor, hf_config: Mapping[str, Any]) -> OneInput:
        """The tokens as the source, and as the teacher-forced target after the decoder's start token."""
        start = int(hf_config.get("decoder_start_token_id") or 0)
        target = torch.cat([torch.tensor([[start]]), tokens[:, :-1]], dim=1)
        return OneInput((tokens, target), {"input_ids": tokens, "decoder_input_ids": target})
