import pytest
import torch

from llmkit import analyze, build_model, get_preset
from llmkit.analysis import component_of
from llmkit.config.presets import PRESETS


def test_kv_cache_per_token_shows_what_mqa_gqa_and_mla_save():
    mha = analyze(get_preset("llama2-7b"), dtype="fp16")
    gqa = analyze(get_preset("llama2-70b"), dtype="fp16")
    v3 = analyze(get_preset("deepseek-v3"), dtype="bf16")
    assert mha.kv_cache_elements_per_token_per_layer == 2 * 32 * 128
    assert mha.kv_cache_bytes_per_token == 32 * 2 * 32 * 128 * 2  # 512 KiB per token
    assert gqa.kv_cache_elements_per_token_per_layer == 2 * 8 * 128
    assert v3.kv_cache_elements_per_token_per_layer == 576  # latent 512 + shared rope key 64
    assert v3.kv_cache_bytes_per_token == 61 * 576 * 2
    v32 = analyze(get_preset("deepseek-v3.2"))
    assert v32.kv_cache_elements_per_token_per_layer == 576 + 128  # plus the indexer key
    assert analyze(get_preset("llama2-7b"), seq_len=4096).kv_cache_bytes == 4096 * mha.kv_cache_bytes_per_token


@pytest.mark.parametrize("name", [n for n in PRESETS if n.endswith("-tiny")])
def test_predicted_cache_bytes_equal_an_allocated_cache(name):
    cfg = get_preset(name)
    report = analyze(cfg, dtype="fp32")
    model = build_model(cfg)
    cache = model.new_cache(1, 10)
    self_bytes = sum(c.nbytes for c in cache.layers)
    assert self_bytes == 10 * report.kv_cache_bytes_per_token


def test_flops_for_a_dense_model_by_hand():
    cfg = get_preset("llama2-7b")
    r = analyze(cfg, seq_len=1)
    matmul = r.params_total - 32000 * 4096 - (2 * 32 + 1) * 4096  # no input embedding lookup, no norm gains
    assert r.flops_per_token == pytest.approx(2 * matmul + 32 * 4 * 32 * 128 * 1)
    long = analyze(cfg, seq_len=4095)
    assert long.flops_per_token - r.flops_per_token == pytest.approx(32 * 4 * 32 * 128 * (2048 - 1))


def test_sparse_attention_caps_attended_keys():
    dense, sparse = get_preset("deepseek-v3"), get_preset("deepseek-v3.2")
    short = analyze(sparse, seq_len=2048).flops_per_token - analyze(dense, seq_len=2048).flops_per_token
    long = analyze(sparse, seq_len=65536).flops_per_token - analyze(dense, seq_len=65536).flops_per_token
    assert short > 0  # below topk every key is selected: the indexer only adds cost
    assert long < 0  # far beyond topk sparse attention is cheaper


def test_components_and_active_parameters():
    r = analyze(get_preset("mixtral-8x7b"))
    assert r.params_by_component["experts (routed)"] == 32 * 8 * 3 * 4096 * 14336
    assert r.active_by_component["experts (routed)"] == 32 * 2 * 3 * 4096 * 14336
    assert sum(r.params_by_component.values()) == r.params_total
    assert r.params_embedding == 32000 * 4096
    v3 = analyze(get_preset("deepseek-v3"))
    assert v3.params_mtp > 0 and v3.weight_bytes == (v3.params_total + v3.params_mtp) * 2
    assert component_of("blocks.3.attn.indexer.wq.weight") == "indexer"
    assert component_of("blocks.3.ffn.shared.w1.weight") == "experts (shared)"
    assert component_of("decoder.0.cross.wq.weight") == "cross-attention"
    assert component_of("blocks.0.attn_residual.norm.weight") == "norms"


def test_encoder_decoder_report():
    r = analyze(get_preset("transformer-base"), dtype="fp32", seq_len=100)
    assert r.architecture == "encoder-decoder"
    assert r.kv_cache_bytes_per_token == 6 * 2 * 512 * 4
    assert r.cross_kv_cache_bytes_per_source_token == 6 * 2 * 512 * 4


def test_bad_arguments():
    from llmkit import ConfigError

    with pytest.raises(ConfigError, match="dtype='int8' is not one of fp32, bf16, fp16"):
        analyze(get_preset("gpt2"), dtype="int8")
    with pytest.raises(ConfigError, match="seq_len=0 must be >= 1"):
        analyze(get_preset("gpt2"), seq_len=0)


def test_meta_build_allocates_nothing():
    model = build_model(get_preset("deepseek-v3"), device="meta")
    assert sum(p.numel() for p in model.parameters()) > 6e11
    assert all(p.is_meta for p in model.parameters())
    assert torch.tensor(0).device.type == "cpu"  # the meta context does not leak
