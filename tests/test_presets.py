import pytest
import torch

import llmkit
from llmkit import ConfigError, analyze, build_model, count_parameters, get_preset
from llmkit.config.presets import PRESETS, Published

FULL = [n for n, p in PRESETS.items() if not n.endswith("-tiny")]
TINY = [n for n in PRESETS if n.endswith("-tiny")]


def check(ours: int, pub: Published) -> None:
    if pub.exact:
        assert ours == pub.value
    else:
        assert abs(ours - pub.value) / pub.value <= pub.rel_tol, (ours, pub.value)


def test_every_base_preset_has_a_tiny_sibling_and_a_source():
    for name in FULL:
        assert name + "-tiny" in PRESETS
        assert PRESETS[name].source
        assert PRESETS[name].params_total is not None


@pytest.mark.parametrize("name", FULL)
def test_preset_builds_on_meta_with_its_published_parameter_count(name):
    preset = PRESETS[name]
    model = build_model(preset.config, device="meta")
    assert all(p.device.type == "meta" for p in model.parameters())
    report = analyze(preset.config, name)
    assert sum(t.numel() for t in model.state_dict().values()) == report.params_total + report.params_mtp
    assert count_parameters(model) == report.params_total + report.params_mtp
    total = report.params_total
    pub = preset.params_total
    assert pub is not None
    if "checkpoint" in pub.convention:  # the MTP layer and its stored copy of the embedding and head
        total = report.params_total + report.params_mtp + 2 * preset.config.vocab_size * preset.config.d_model
    check(total, pub)
    if preset.params_active is not None:
        active = report.params_active
        if "without the input embedding" in preset.params_active.convention:
            active = report.params_active_non_embedding
        check(active, preset.params_active)


def test_exact_counts_follow_from_the_architecture():
    # hand-derived from the published hyperparameters, independently of the model code
    V, d, L, ff = 32000, 4096, 32, 11008
    llama = 2 * V * d + L * (4 * d * d + 3 * d * ff + 2 * d) + d
    assert analyze(get_preset("llama2-7b")).params_total == llama == 6_738_415_616
    V, d, ff = 37000, 512, 2048
    attn = 4 * d * d + 4 * d
    mlp = 2 * d * ff + ff + d
    base = V * d + 6 * (attn + mlp + 2 * 2 * d) + 6 * (2 * attn + mlp + 3 * 2 * d)
    assert analyze(get_preset("transformer-base")).params_total == base  # 63.08M (paper: "65M")
    v3 = analyze(get_preset("deepseek-v3"))
    assert v3.params_total == 671_026_419_200
    indexer = 1536 * 64 * 128 + 7168 * 128 + 2 * 128 + 7168 * 64  # wq, wk, k_norm, head weights
    assert analyze(get_preset("deepseek-v3.2")).params_total - v3.params_total == 61 * indexer


def test_mixtral_active_parameters_by_hand():
    d, ff, L, V = 4096, 14336, 32, 32000
    attn = 2 * d * d + 2 * d * 1024
    shared = attn + 8 * d + 2 * d  # router + norms
    active = 2 * V * d + d + L * (shared + 2 * 3 * d * ff)
    assert analyze(get_preset("mixtral-8x7b")).params_active == active


@pytest.mark.parametrize("name", TINY)
def test_tiny_preset_runs_forward_and_backward(name):
    cfg = get_preset(name)
    assert cfg.attention.kind == PRESETS[name.removesuffix("-tiny")].config.attention.kind
    assert (cfg.moe is None) == (PRESETS[name.removesuffix("-tiny")].config.moe is None)
    model = build_model(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    if cfg.is_encoder_decoder:
        out = model.loss(torch.randint(0, cfg.vocab_size, (2, 9)), tokens, start_id=1)
    else:
        out = model.loss(tokens, start_id=1)
    assert torch.isfinite(out.total)
    out.total.backward()
    # routed experts may receive no token in a tiny batch; the sparse-attention indexer is not differentiable
    # through its top-k selection (DeepSeek-V3.2 trains it with its own KL loss against the main attention)
    missing = [
        n for n, p in model.named_parameters() if p.grad is None and ".experts." not in n and ".indexer." not in n
    ]
    assert not missing, f"parameters without a gradient: {missing}"
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_unknown_preset_suggests_close_names():
    with pytest.raises(ConfigError, match="unknown preset 'llama2-7'; did you mean llama2-7b"):
        get_preset("llama2-7")


def test_top_level_api_lists_presets():
    assert set(llmkit.list_presets()) == set(PRESETS)
