import dataclasses
import json

import pytest

from llmkit import (
    AttentionConfig,
    ConfigError,
    EncoderConfig,
    FFNConfig,
    IndexerConfig,
    MLAConfig,
    ModelConfig,
    MoEConfig,
    PositionConfig,
    RopeScaling,
)
from llmkit.config.presets import PRESETS


def make(**kw):
    base = dict(vocab_size=100, d_model=64, n_layers=2)
    base.update(kw)
    return ModelConfig(**base)


def test_derived_sizes_follow_the_config():
    cfg = make(attention=AttentionConfig(n_heads=4))
    assert cfg.head_dim == 16 and cfg.n_kv_heads == 4
    assert cfg.ffn_hidden_dim == 256  # LLaMA rule: 2/3 * 4 * 64 = 170, rounded up to a multiple of 256
    assert make(ffn=FFNConfig(kind="mlp")).ffn_hidden_dim == 256  # 4 * d_model
    assert make(attention=AttentionConfig(n_heads=4), d_model=4096).ffn_hidden_dim == 11008  # LLaMA-2 7B
    # the config keeps what was given, so a changed width derives them again, and JSON round-trips it unchanged
    assert cfg.attention.head_dim is None and cfg.ffn.hidden_dim is None
    wider = dataclasses.replace(cfg, d_model=128)
    assert (wider.head_dim, wider.ffn_hidden_dim) == (32, 512)
    assert ModelConfig.from_json(wider.to_json()) == wider
    resolved = wider.resolved()
    assert (resolved.attention.head_dim, resolved.attention.n_kv_heads, resolved.ffn.hidden_dim) == (32, 4, 512)
    assert resolved.architecture() == wider.architecture()


def test_gqa_divisibility_message_names_fields_value_and_valid_choices():
    with pytest.raises(ConfigError) as e:
        make(d_model=768, attention=AttentionConfig(n_heads=12, n_kv_heads=5))
    assert str(e.value) == (
        "attention.n_heads=12 is not divisible by attention.n_kv_heads=5 (valid n_kv_heads: 1, 2, 3, 4, 6, 12)"
    )


@pytest.mark.parametrize(
    ("build", "fragment"),
    [
        (
            lambda: dict(d_model=100, attention=AttentionConfig(n_heads=3)),
            "d_model=100 is not divisible by attention.n_heads=3",
        ),
        (lambda: dict(vocab_size=0), "vocab_size=0 must be between 1 and 16,777,216"),
        (lambda: dict(n_layers=0), "n_layers=0 must be between 1 and 4,096"),
        (lambda: dict(n_layers=10**12), "n_layers=1000000000000 must be between 1 and 4,096"),
        (lambda: dict(d_model=2**40), "d_model=1099511627776 must be between 1 and 131,072"),
        (lambda: dict(dropout=1.0), "dropout=1.0 must be in [0, 1)"),
        (lambda: dict(attention=AttentionConfig(mla=MLAConfig())), "attention.mla=MLAConfig("),
        (
            lambda: dict(attention=AttentionConfig(kind="mla")),
            "attention.mla=None is required for attention.kind='mla'",
        ),
        (
            lambda: dict(attention=AttentionConfig(kind="dsa", mla=MLAConfig())),
            "attention.indexer=None is required",
        ),
        (
            lambda: dict(
                attention=AttentionConfig(kind="mla", mla=MLAConfig()),
                position=PositionConfig(kind="learned"),
            ),
            "position.kind='learned' cannot be used with attention.kind='mla'",
        ),
        (lambda: dict(moe=MoEConfig(n_experts=8, top_k=9)), "moe.top_k=9 must be between 1 and n_experts=8"),
        (
            lambda: dict(moe=MoEConfig(n_experts=8, n_groups=3)),
            "moe.n_groups=3 must divide moe.n_experts=8 (valid n_groups: 1, 2, 4, 8)",
        ),
        (
            lambda: dict(moe=MoEConfig(n_experts=8, n_groups=4, topk_groups=1, top_k=4)),
            "moe.top_k=4 exceeds the 2 experts",
        ),
        (lambda: dict(moe=MoEConfig(first_dense_layers=3)), "moe.first_dense_layers=3 exceeds n_layers=2"),
        (lambda: dict(moe=MoEConfig(capacity_factor=0.0)), "moe.capacity_factor=0.0 must be > 0"),
        (
            lambda: dict(encoder=EncoderConfig(), attention=AttentionConfig(kind="mla", mla=MLAConfig())),
            "attention.kind='mla' is not supported in an encoder-decoder model",
        ),
        (
            lambda: dict(position=PositionConfig(kind="sinusoidal", scaling=RopeScaling(kind="linear", factor=2.0))),
            "position.kind='sinusoidal' does not use position.scaling",
        ),
        (lambda: dict(position=PositionConfig(rope_fraction=0.01)), "RoPE needs an even number >= 2"),
        (
            lambda: dict(
                position=PositionConfig(rope_fraction=0.125, scaling=RopeScaling(kind="ntk", factor=2.0)),
                attention=AttentionConfig(n_heads=4),
            ),
            "position.scaling.kind='ntk' needs at least 4 rotary dims",
        ),
        (
            lambda: dict(attention=AttentionConfig(kind="gqa", n_heads=4, n_kv_heads=0)),
            "attention.n_kv_heads=0 must be >= 1",
        ),
        (
            lambda: dict(attention=AttentionConfig(n_heads="4")),
            "attention.n_heads='4' has the wrong type: expected int",
        ),
        (
            lambda: dict(attention=AttentionConfig(kind="flash")),
            "attention.kind='flash' has the wrong type: expected one of 'gqa', 'mla', 'dsa'",
        ),
        (lambda: dict(tie_embeddings=1), "tie_embeddings=1 has the wrong type: expected bool"),
        (
            lambda: dict(
                attention=AttentionConfig(
                    kind="dsa", mla=MLAConfig(qk_rope_head_dim=64), indexer=IndexerConfig(head_dim=32)
                )
            ),
            "attention.indexer.head_dim=32 must be >= attention.mla.qk_rope_head_dim=64",
        ),
    ],
)
def test_bad_configs_raise_clear_errors(build, fragment):
    with pytest.raises(ConfigError) as e:
        make(**build())
    assert fragment in str(e.value)


@pytest.mark.parametrize(
    ("scaling", "fragment"),
    [
        (
            dict(kind="yarn", factor=4.0),
            "position.scaling.original_max_seq_len=None is required for kind='yarn'",
        ),
        (dict(kind="linear", factor=0.0), "position.scaling.factor=0.0 must be > 0"),
        (
            dict(
                kind="llama3",
                factor=8.0,
                original_max_seq_len=8192,
                low_freq_factor=4.0,
                high_freq_factor=1.0,
            ),
            "position.scaling.high_freq_factor=1.0 must be > low_freq_factor=4.0",
        ),
    ],
)
def test_bad_rope_scaling(scaling, fragment):
    with pytest.raises(ConfigError) as e:
        RopeScaling(**scaling)
    assert fragment in str(e.value)


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_round_trips_through_json(name, tmp_path):
    cfg = PRESETS[name].config
    assert ModelConfig.from_json(cfg.to_json()) == cfg
    path = tmp_path / "cfg.json"
    cfg.to_json(path)
    assert ModelConfig.from_json(path) == cfg


def test_from_dict_rejects_unknown_fields_and_bad_json(tmp_path):
    data = json.loads(make().to_json())
    data["attention"]["n_head"] = 12
    with pytest.raises(ConfigError, match=r"unknown field\(s\) \['n_head'\] in attention; valid fields: kind, n_heads"):
        ModelConfig.from_dict(data)
    with pytest.raises(ConfigError, match="does not exist"):
        ModelConfig.from_json(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_json("{not json")
    with pytest.raises(ConfigError, match="missing 1 required"):
        ModelConfig.from_dict({"vocab_size": 10, "d_model": 8})


def test_configs_are_frozen_and_replace_revalidates():
    cfg = make()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.d_model = 3  # type: ignore[misc]
    with pytest.raises(ConfigError):
        dataclasses.replace(cfg, attention=AttentionConfig(n_heads=5))
