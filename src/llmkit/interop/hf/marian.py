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

from collections.abc import Collection
from typing import Any, ClassVar

from llmkit.config import AttentionConfig, EncoderConfig, FFNConfig, ModelConfig, NormConfig, PositionConfig
from llmkit.errors import ConfigError
from llmkit.interop.hf.base import Family, activation_from_hf, require
from llmkit.interop.keymap import Reshape, Rule

_ACT_NAMES = {"silu": "swish", "gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}


def _attention(theirs: str, ours: str, where: str) -> list[Rule]:
    rules = []
    for a, b in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "out_proj")):
        for p in ("weight", "bias"):
            rules.append(Rule(f"{ours}{a}.{p}", f"{theirs}{b}.{p}", where=where))
    return rules


def _norm(theirs: str, ours: str, where: str) -> list[Rule]:
    return [Rule(f"{ours}.{p}", f"{theirs}.{p}", where=where) for p in ("weight", "bias")]


class MarianFamily(Family):
    name = "marian"
    model_types: ClassVar[tuple[str, ...]] = ("marian",)
    architectures: ClassVar[dict[str, str]] = {"marian": "MarianMTModel"}

    def config_from_hf(self, hf: dict[str, Any], names: Collection[str]) -> ModelConfig:
        for a, b in (("encoder_attention_heads", "decoder_attention_heads"), ("encoder_ffn_dim", "decoder_ffn_dim")):
            if require(hf, a) != require(hf, b):
                raise ConfigError(f"config.json {a}={hf[a]} differs from {b}={hf[b]}, which llmkit does not support")
        vocab = int(require(hf, "vocab_size"))
        shared = bool(hf.get("share_encoder_decoder_embeddings", True))
        target_vocab = int(hf.get("decoder_vocab_size") or vocab)
        if shared and target_vocab != vocab:
            raise ConfigError("config.json shares embeddings but gives different source and target vocabularies")
        return ModelConfig(
            vocab_size=target_vocab,
            d_model=int(require(hf, "d_model")),
            n_layers=int(require(hf, "decoder_layers")),
            encoder=EncoderConfig(n_layers=int(require(hf, "encoder_layers")), vocab_size=None if shared else vocab),
            attention=AttentionConfig(
                n_heads=int(hf["encoder_attention_heads"]),
                qkv_bias=True,
                out_bias=True,
                dropout=float(hf.get("attention_dropout", 0.0)),
            ),
            ffn=FFNConfig(
                kind="mlp",
                hidden_dim=int(hf["encoder_ffn_dim"]),
                activation=activation_from_hf(hf.get("activation_function", "swish"), "activation_function"),
                bias=True,
            ),
            position=PositionConfig(
                kind="sinusoidal", max_seq_len=int(hf.get("max_position_embeddings", 512)), layout="half"
            ),
            norm=NormConfig(kind="layernorm", placement="post", eps=1e-5),
            tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
            scale_embeddings=bool(hf.get("scale_embedding", False)),
            head_bias=True,
            dropout=float(hf.get("dropout", 0.0)),
            init="xavier",
        )

    def config_to_hf(self, cfg: ModelConfig, model_type: str) -> dict[str, Any]:
        a, f, e = cfg.attention, cfg.ffn, cfg.encoder
        ok = (
            e is not None
            and a.kind == "gqa"
            and a.n_kv_heads == a.n_heads
            and a.qkv_bias
            and a.out_bias
            and cfg.head_dim * a.n_heads == cfg.d_model
            and f.kind == "mlp"
            and f.bias
            and cfg.moe is None
            and cfg.position.kind == "sinusoidal"
            and cfg.position.layout == "half"
            and cfg.norm.kind == "layernorm"
            and cfg.norm.placement == "post"
            and cfg.norm.bias
            and cfg.norm.eps == 1e-5
            and cfg.head_bias
        )
        if not ok or e is None:
            raise ConfigError(
                "only a post-norm encoder-decoder with sine-first sinusoids and a logits bias maps to Marian"
            )
        return {
            "model_type": "marian",
            "architectures": ["MarianMTModel"],
            "vocab_size": e.vocab_size or cfg.vocab_size,
            "decoder_vocab_size": cfg.vocab_size,
            "share_encoder_decoder_embeddings": e.vocab_size is None,
            "d_model": cfg.d_model,
            "encoder_layers": e.n_layers,
            "decoder_layers": cfg.n_layers,
            "encoder_attention_heads": a.n_heads,
            "decoder_attention_heads": a.n_heads,
            "encoder_ffn_dim": f.hidden_dim,
            "decoder_ffn_dim": f.hidden_dim,
            "activation_function": _ACT_NAMES[f.activation],
            "max_position_embeddings": cfg.position.max_seq_len,
            "scale_embedding": cfg.scale_embeddings,
            "tie_word_embeddings": cfg.tie_embeddings,
            "dropout": cfg.dropout,
            "attention_dropout": a.dropout,
            "is_encoder_decoder": True,
        }

    def rules(self, cfg: ModelConfig, names: Collection[str]) -> list[Rule]:
        enc, dec = "model.encoder.layers.{i}.", "model.decoder.layers.{i}."
        rules = [
            *_attention(enc + "self_attn.", "encoder.{i}.attn.", "encoder"),
            *_norm(enc + "self_attn_layer_norm", "encoder.{i}.attn_residual.norm", "encoder"),
            *_attention(dec + "self_attn.", "decoder.{i}.attn.", "decoder"),
            *_norm(dec + "self_attn_layer_norm", "decoder.{i}.attn_residual.norm", "decoder"),
            *_attention(dec + "encoder_attn.", "decoder.{i}.cross.", "decoder"),
            *_norm(dec + "encoder_attn_layer_norm", "decoder.{i}.cross_residual.norm", "decoder"),
            Rule("head_bias", "final_logits_bias", Reshape((1, cfg.vocab_size))),
        ]
        for layers, where in ((enc, "encoder"), (dec, "decoder")):
            ours = "encoder.{i}." if where == "encoder" else "decoder.{i}."
            for p in ("weight", "bias"):
                rules += [
                    Rule(f"{ours}ffn.w1.{p}", f"{layers}fc1.{p}", where=where),
                    Rule(f"{ours}ffn.w2.{p}", f"{layers}fc2.{p}", where=where),
                ]
            rules += _norm(layers + "final_layer_norm", ours + "ffn_residual.norm", where)
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
        if name in tied_copies or (cfg.tie_embeddings and name == "lm_head.weight"):
            return True
        return super().ignored(name, cfg)
