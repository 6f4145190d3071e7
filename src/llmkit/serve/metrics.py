"""What `GET /metrics` reports, in Prometheus' text format (through prometheus_client, with a registry of our own
so that two servers in one process never share counters), and `GET /metrics.json`, the same samples as JSON for the
web page (serve/ui/) with the last steps' costs beside them: one source for both."""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from llmkit.serve.engine import Engine
    from llmkit.serve.telemetry import Telemetry

# seconds: from a few ms (a decode step of a small model) to minutes (a long queue)
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# a step's fraction of the machine's limit (telemetry.py): above 1 where the weights fit a cache the measured read
# does not (a tiny model), or the limit was measured at a busy moment
_FRACTION_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0)
# a step's rows: decoding rows, prompt tokens (up to the step's token budget)
_ROW_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
# the steps /metrics.json lists (the page draws them): a few seconds of a busy server
RECENT_STEPS = 240


class Metrics:
    """The server's gauges, counters and latency histograms."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.running = Gauge("llmkit_requests_running", "Sequences in the running batch", registry=r)
        self.waiting = Gauge("llmkit_requests_waiting", "Sequences waiting to be admitted", registry=r)
        self.blocks_used = Gauge("llmkit_kv_blocks_used", "Paged-cache blocks in use", registry=r)
        self.blocks_total = Gauge("llmkit_kv_blocks_total", "Paged-cache blocks in the pool", registry=r)
        self.blocks_cached = Gauge(
            "llmkit_kv_blocks_cached", "Free blocks still holding a cached prefix (reused last)", registry=r
        )
        # the engine's own counts since start, exported as counters (they only grow; see _advance)
        self.prefix_queried = Counter("llmkit_prefix_cache_queried_blocks", "Prompt blocks looked up", registry=r)
        self.prefix_hit = Counter("llmkit_prefix_cache_hit_blocks", "Prompt blocks found in the cache", registry=r)
        self.restored = Counter(
            "llmkit_prefix_cache_restored_blocks", "Prompt blocks brought back from a tier", ["tier"], registry=r
        )
        self.preemptions = Counter("llmkit_preemptions", "Sequences preempted for memory", registry=r)
        self.prompt_tokens = Counter("llmkit_prompt_tokens", "Prompt tokens computed", registry=r)
        self.drafted = Counter("llmkit_spec_draft_tokens", "Tokens drafted (with --mtp)", registry=r)
        self.accepted = Counter("llmkit_spec_accepted_tokens", "Drafted tokens the model kept", registry=r)
        self._seen: dict[Counter, float] = {}
        self.generated = Counter("llmkit_generated_tokens", "Tokens generated", registry=r)
        self.requests = Counter("llmkit_requests_finished", "Requests finished", ["finish_reason"], registry=r)
        self.ttft = Histogram(
            "llmkit_time_to_first_token_seconds", "Arrival to first token", buckets=_TTFT_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "llmkit_inter_token_latency_seconds", "Time between a sequence's tokens", buckets=_ITL_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "llmkit_request_latency_seconds", "Arrival to the last sequence's end", buckets=_E2E_BUCKETS, registry=r
        )
        self.queue = Histogram(
            "llmkit_request_queue_seconds", "Arrival to the first step with its work", buckets=_E2E_BUCKETS, registry=r
        )
        # what the steps cost against the machine's limits (serve/telemetry.py)
        self.step_weight_bytes = Gauge("llmkit_step_weight_read_bytes", "Weight bytes the last step read", registry=r)
        self.step_kv_bytes = Gauge("llmkit_step_kv_cache_read_bytes", "KV-cache bytes the last step read", registry=r)
        self.step_flops = Gauge("llmkit_step_flops", "FLOPs of the last step's rows", registry=r)
        self.step_seconds = Gauge("llmkit_step_seconds", "Seconds the last step took", registry=r)
        self.weight_bytes = Counter("llmkit_weight_read_bytes", "Weight bytes read by the steps", registry=r)
        self.kv_bytes = Counter("llmkit_kv_cache_read_bytes", "KV-cache bytes read by the steps", registry=r)
        self.flops = Counter("llmkit_flops", "FLOPs of the steps' rows", registry=r)
        self.step_time = Counter("llmkit_step_time_seconds", "Seconds the counted steps took", registry=r)
        self.bandwidth_fraction = Histogram(
            "llmkit_step_bandwidth_ratio", "A step's bytes read / seconds / the memory bandwidth measured at start",
            buckets=_FRACTION_BUCKETS, registry=r,
        )  # fmt: skip
        self.matmul_fraction = Histogram(
            "llmkit_step_matmul_ratio", "A step's FLOPs / seconds / the matmul peak measured at start",
            buckets=_FRACTION_BUCKETS, registry=r,
        )  # fmt: skip
        self.steps = Counter("llmkit_steps", "Engine steps that ran work", registry=r)
        self.step_decode_rows = Histogram(
            "llmkit_step_decode_rows", "Decoding rows in a step", buckets=_ROW_BUCKETS, registry=r
        )
        self.step_prompt_tokens = Histogram(
            "llmkit_step_prompt_tokens", "Prompt tokens computed in a step", buckets=_ROW_BUCKETS, registry=r
        )
        self.memory_bandwidth = Gauge(
            "llmkit_machine_memory_bandwidth_bytes_per_second", "Memory read bandwidth measured at start", registry=r
        )
        self.matmul_peak = Gauge("llmkit_machine_matmul_flops_per_second", "Matmul peak measured at start", registry=r)
        self._steps_seen = 0
        self._recent: deque[dict[str, float]] = deque(maxlen=RECENT_STEPS)
        self._recent_lock = threading.Lock()  # appended in the engine's thread, read in the HTTP one

    def observe_engine(self, engine: Engine) -> None:
        s = engine.scheduler
        self.running.set(len(s.running))
        self.waiting.set(len(s.waiting))
        self.blocks_used.set(engine.pool.used)
        self.blocks_total.set(engine.pool.n_blocks)
        self.blocks_cached.set(engine.pool.idle_cached)
        self._advance(self.prefix_queried, s.prefix.queried)
        self._advance(self.prefix_hit, s.prefix.hit)
        if engine.store is not None:
            for tier, count in engine.store.restored.items():
                self._advance(self.restored.labels(tier=tier), count)
        self._advance(self.preemptions, s.preemptions)
        self._advance(self.prompt_tokens, engine.stats.prompt_tokens)
        self._advance(self.drafted, engine.drafter.drafted)
        self._advance(self.accepted, engine.drafter.accepted)
        self._observe_steps(engine.telemetry)

    def _observe_steps(self, t: Telemetry) -> None:
        """The last step's cost, the totals, and (once per step) its fractions of the limits."""
        if t.limits is not None:
            self.memory_bandwidth.set(t.limits.bandwidth)
            self.matmul_peak.set(t.limits.matmul)
        self._advance(self.weight_bytes, t.weight_bytes)
        self._advance(self.kv_bytes, t.kv_bytes)
        self._advance(self.flops, t.flops)
        self._advance(self.step_time, t.seconds)
        self._advance(self.steps, t.steps)
        if t.last is None or t.steps == self._steps_seen:
            return
        self._steps_seen = t.steps  # (called after every step: the last one is the only new one)
        self.step_decode_rows.observe(t.last.decode_rows)
        self.step_prompt_tokens.observe(t.last.prompt_tokens)
        self.step_weight_bytes.set(t.last.weight_bytes)
        self.step_kv_bytes.set(t.last.kv_bytes)
        self.step_flops.set(t.last.flops)
        self.step_seconds.set(t.last_seconds)
        step = {"time": time.time(), "seconds": t.last_seconds, "decode_rows": t.last.decode_rows,
                "prompt_tokens": t.last.prompt_tokens, "drafts": t.last.drafts, "weight_bytes": t.last.weight_bytes,
                "kv_bytes": t.last.kv_bytes, "flops": t.last.flops}  # fmt: skip
        if t.last_fractions is not None:
            self.bandwidth_fraction.observe(t.last_fractions[0])
            self.matmul_fraction.observe(t.last_fractions[1])
            step.update(bandwidth_ratio=t.last_fractions[0], matmul_ratio=t.last_fractions[1])
        with self._recent_lock:
            self._recent.append(step)

    def _advance(self, counter: Any, total: float) -> None:
        """Bring a counter up to the engine's running total."""
        counter.inc(max(total - self._seen.get(counter, 0.0), 0.0))
        self._seen[counter] = total

    def text(self) -> bytes:
        return generate_latest(self.registry)

    def snapshot(self) -> dict[str, Any]:
        """/metrics.json: every sample of `text()` under the name and labels it has there (`name{label="value"}`),
        the time it was read, and the last RECENT_STEPS steps (each: its rows, seconds, bytes, FLOPs and fractions of
        the limits, as the gauges and histograms above saw it)."""
        samples = {_sample_key(s.name, s.labels): s.value if math.isfinite(s.value) else None
                   for f in self.registry.collect() for s in f.samples}  # fmt: skip
        with self._recent_lock:
            steps = list(self._recent)
        return {"time": time.time(), "samples": samples, "steps": steps}


def _sample_key(name: str, labels: dict[str, str]) -> str:
    """A sample's name as Prometheus' text format writes it (labels in order, values escaped the same way)."""
    if not labels:
        return name
    escaped = (v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"') for v in labels.values())
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in zip(labels, escaped, strict=True)) + "}"
