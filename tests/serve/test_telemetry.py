"""A serving step's cost (serve/telemetry.py): the bytes of weights and KV cache it reads and the FLOPs of its rows
equal a count made here by hand from the model's configuration and the step's rows; the fractions of the machine's
limits follow from them; `--log-steps` lines carry them."""

from __future__ import annotations

import json

import pytest
import torch

import llmkit
from llmkit.serve.forward import Row
from llmkit.serve.paged import PagedCache
from llmkit.serve.telemetry import Limits, StepCosts, StepLog, Telemetry

# a decoding row (its token at position 10, two drafts after it), a whole 6-token prompt, and a 3-token chunk of a
# prompt from position 6 whose first two tokens' log-probabilities were asked for
ROWS = (
    Row([5], 10, [0, 1, 2, 3], drafts=(1, 2)),
    Row(list(range(6)), 0, [4, 5], given=6),
    Row([1, 2, 3], 6, [6, 7, 8], prompt_n=2, given=3),
)
QUERIES = [10, 11, 12, *range(6), 6, 7, 8]  # each computed token's position
CONTEXTS = [13, 6, 9]  # the keys each row's last query sees
LOGITS = (1 + 2) + 1 + (1 + 2)  # a row's last token, each draft, the prompt tokens asked for


def build(preset: str, kv_dtype: str | None = None):
    torch.manual_seed(0)
    model = llmkit.build_model(llmkit.get_preset(preset)).eval()
    cache = PagedCache(model, 16, 4, torch.device("cpu"), torch.float32, kv_dtype=kv_dtype)
    return model, cache


def dims(cfg):
    a = cfg.attention
    heads, kv = a.n_heads, a.n_kv_heads or a.n_heads
    hd = cfg.head_dim
    attn_params = cfg.d_model * heads * hd + 2 * cfg.d_model * kv * hd + heads * hd * cfg.d_model
    return heads, kv, hd, attn_params


@pytest.mark.parametrize("kv_dtype", [None, "int8", "fp8"])
def test_a_dense_model_s_step_cost_equals_a_count_from_its_configuration(kv_dtype):
    model, cache = build("llama2-7b-tiny", kv_dtype)
    cfg = model.cfg
    heads, kv, hd, attn_params = dims(cfg)
    per_layer = attn_params + 3 * cfg.d_model * cfg.ffn.hidden_dim  # wq, wk, wv, wo; w1, w3, w2
    head = cfg.d_model * cfg.vocab_size
    pairs = sum(p + 1 for p in QUERIES)  # causal: a query at position p scores p + 1 keys
    flops = 2 * (len(QUERIES) * cfg.n_layers * per_layer + LOGITS * head) + cfg.n_layers * 2 * heads * 2 * hd * pairs
    # every parameter is read but the input embedding table (a lookup; the head is its own matrix here)
    weights = 4 * sum(p.numel() for n, p in model.named_parameters() if not n.startswith("embed."))
    per_token = 2 * kv * (hd * 4 if kv_dtype is None else hd + 4)  # a key and a value: fp32, or byte codes + a scale
    cost = StepCosts(model, cache).of(ROWS)
    assert (cost.decode_rows, cost.prompt_tokens, cost.drafts) == (1, 9, 2)
    assert cost.flops == flops
    assert cost.weight_bytes == weights
    assert cost.kv_bytes == pytest.approx(cfg.n_layers * per_token * sum(CONTEXTS), rel=1e-12)


def test_a_mixture_of_experts_reads_the_experts_its_tokens_reach():
    model, cache = build("mixtral-8x7b-tiny")
    cfg, moe = model.cfg, model.cfg.moe
    heads, _, hd, attn_params = dims(cfg)
    expert = 3 * cfg.d_model * moe.expert_hidden_dim  # one swiglu expert's matrices
    costs = StepCosts(model, cache)
    one = costs.of([Row([5], 3, [0])])  # a single token reaches exactly top_k experts a layer
    all_params = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("embed."))
    untouched = cfg.n_layers * (moe.n_experts - moe.top_k) * expert
    assert one.weight_bytes == pytest.approx(4 * (all_params - untouched), rel=1e-12)
    router = cfg.d_model * moe.n_experts
    per_token = cfg.n_layers * (attn_params + router + moe.top_k * expert)
    assert one.flops == 2 * (per_token + cfg.d_model * cfg.vocab_size) + cfg.n_layers * 2 * heads * 2 * hd * 4
    many = costs.of([Row(list(range(64)), 0, list(range(16)))])  # 64 tokens reach all 8 but for ~(3/4)^64
    assert many.weight_bytes == pytest.approx(4 * all_params, rel=1e-6)


def test_a_sliding_window_layer_reads_and_scores_at_most_its_window():
    model, cache = build("gemma3-1b-tiny")  # local layers of a 16-key window; the head is the embedding table
    cfg = model.cfg
    heads, kv, hd, attn_params = dims(cfg)
    window, every = cfg.attention.sliding_window, cfg.attention.full_every
    position = 40  # a decoding row past the window
    keys = [position + 1 if (i + 1) % every == 0 else window for i in range(cfg.n_layers)]
    cost = StepCosts(model, cache).of([Row([5], position, [0] * 11)])
    assert cost.kv_bytes == pytest.approx(sum(2 * kv * hd * 4 * k for k in keys), rel=1e-12)
    per_layer = attn_params + 3 * cfg.d_model * cfg.ffn.hidden_dim
    matmul = 2 * (cfg.n_layers * per_layer + cfg.d_model * cfg.vocab_size)
    assert cost.flops == matmul + sum(2 * heads * 2 * hd * k for k in keys)
    assert cost.weight_bytes == 4 * sum(p.numel() for p in model.parameters())  # tied: the table is the head


def test_sparse_attention_attends_its_top_k_keys_and_indexes_them_all():
    model, cache = build("deepseek-v3.2-tiny")
    cfg = model.cfg
    mla, ix = cfg.attention.mla, cfg.attention.indexer
    costs = StepCosts(model, cache)

    def grows(position: int) -> tuple[float, float]:
        """What one more key before a decoding row adds: (FLOPs, KV bytes)."""
        a, b = costs.of([Row([5], position, [0] * 16)]), costs.of([Row([5], position + 1, [0] * 16)])
        return b.flops - a.flops, b.kv_bytes - a.kv_bytes

    attend = 2 * cfg.attention.n_heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim + mla.v_head_dim)
    index = 2 * ix.n_heads * ix.head_dim
    latent, index_key = 4 * (mla.kv_lora_rank + mla.qk_rope_head_dim), 4 * ix.head_dim  # fp32 bytes a token
    early, late = grows(2), grows(ix.topk + 20)
    # below top-k a new key is attended and indexed; past it, only indexed (the query still attends top-k keys)
    assert early[0] == cfg.n_layers * (attend + index)
    assert early[1] == pytest.approx(cfg.n_layers * (latent + index_key))
    assert late[0] == cfg.n_layers * index and late[1] == pytest.approx(cfg.n_layers * index_key)


def test_fractions_of_the_limits_and_the_step_log(tmp_path):
    model, cache = build("llama2-7b-tiny")
    cost = StepCosts(model, cache).of(ROWS)
    limits = Limits(bandwidth=1e10, matmul=1e11, dtype="float32", seconds=0.0)
    bandwidth, matmul = cost.fractions(0.5, limits)
    assert bandwidth == pytest.approx((cost.weight_bytes + cost.kv_bytes) / 0.5 / 1e10)
    assert matmul == pytest.approx(cost.flops / 0.5 / 1e11)
    log = StepLog(tmp_path / "steps.jsonl")
    log.write(12.5, 0.5, cost, (bandwidth, matmul))
    log.write(13.0, 0.25, cost, cost.fractions(0.25, limits))
    log.close()
    lines = [json.loads(x) for x in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and lines[0]["flops"] == cost.flops and lines[0]["prompt_tokens"] == 9
    assert lines[1]["bandwidth_fraction"] == pytest.approx(2 * bandwidth)


def test_a_step_that_failed_after_its_plan_is_not_counted_by_the_next():
    model, cache = build("llama2-7b-tiny")
    telemetry = Telemetry(StepCosts(model, cache))
    telemetry.begin()
    telemetry.planned(ROWS)  # ... and the step raised before it finished
    telemetry.begin()  # the next step found no work
    telemetry.finished(0.1, 0.0)
    assert telemetry.steps == 0 and telemetry.last is None and telemetry.flops == 0


def test_the_limits_are_measured_in_about_a_second():
    limits = Limits.measure(torch.device("cpu"), torch.float32)
    assert limits.bandwidth > 0 and limits.matmul > 0 and limits.dtype == "float32"
    assert "GB/s" in str(limits) and "GFLOP/s" in str(limits)


def test_the_engine_logs_every_step_and_the_metrics_carry_the_last(tmp_path):
    from llmkit.serve.engine import Engine, EngineConfig
    from llmkit.serve.metrics import Metrics
    from llmkit.serve.request import SamplingParams

    model, _ = build("llama2-7b-tiny")
    path = tmp_path / "steps.jsonl"
    engine = Engine(model, None, EngineConfig(kv_memory=1 << 20, log_steps=str(path), batch_invariant=False))
    engine.telemetry.limits = Limits(bandwidth=1e10, matmul=1e11, dtype="float32", seconds=0.0)
    metrics = Metrics()
    engine.add(list(range(1, 8)), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    while engine.has_work:
        engine.step()
        metrics.observe_engine(engine)
    engine.close()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(lines) == engine.stats.steps == engine.telemetry.steps == 3  # the prompt, then two decoding steps
    assert [(x["decode_rows"], x["prompt_tokens"]) for x in lines] == [(0, 7), (1, 0), (1, 0)]
    # the first step computed the 7-token prompt: 7 queries over 1..7 keys, logits for its last token
    assert lines[0]["flops"] == StepCosts(model, engine.cache).of([Row(list(range(1, 8)), 0, [0])]).flops
    assert all(x["bandwidth_fraction"] > 0 and x["matmul_fraction"] > 0 for x in lines)
    samples = dict(line.rsplit(" ", 1) for line in metrics.text().decode().splitlines() if not line.startswith("#"))
    assert float(samples["llmkit_step_flops"]) == lines[-1]["flops"]
    assert float(samples["llmkit_step_bandwidth_ratio_count"]) == 3
    assert float(samples["llmkit_flops_total"]) == pytest.approx(sum(x["flops"] for x in lines))
    assert float(samples["llmkit_machine_memory_bandwidth_bytes_per_second"]) == 1e10
    assert float(samples["llmkit_steps_total"]) == 3 and float(samples["llmkit_step_prompt_tokens_sum"]) == 7
    assert float(samples['llmkit_step_decode_rows_bucket{le="1.0"}']) == 3  # 0, 1, 1 decoding rows
