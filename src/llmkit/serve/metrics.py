"""What `GET /metrics` reports, in Prometheus' text format (through prometheus_client, with a registry of our own
so that two servers in one process never share counters)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from llmkit.serve.engine import Engine

# seconds: from a few ms (a decode step of a small model) to minutes (a long queue)
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    """The server's gauges, counters and latency histograms."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.running = Gauge("llmkit_requests_running", "Sequences in the running batch", registry=r)
        self.waiting = Gauge("llmkit_requests_waiting", "Sequences waiting to be admitted", registry=r)
        self.blocks_used = Gauge("llmkit_kv_blocks_used", "Paged-cache blocks in use", registry=r)
        self.blocks_total = Gauge("llmkit_kv_blocks_total", "Paged-cache blocks in the pool", registry=r)
        self.prefix_queried = Gauge("llmkit_prefix_cache_queried_blocks", "Prompt blocks looked up", registry=r)
        self.prefix_hit = Gauge("llmkit_prefix_cache_hit_blocks", "Prompt blocks found in the cache", registry=r)
        self.preemptions = Gauge("llmkit_preemptions", "Sequences preempted for memory since start", registry=r)
        self.prompt_tokens = Gauge("llmkit_prompt_tokens", "Prompt tokens computed since start", registry=r)
        self.generated = Counter("llmkit_generated_tokens", "Tokens generated", registry=r)
        self.requests = Counter("llmkit_requests_finished", "Requests finished", ["finish_reason"], registry=r)
        self.ttft = Histogram(
            "llmkit_time_to_first_token_seconds", "Arrival to first token", buckets=_TTFT_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "llmkit_inter_token_latency_seconds", "Time between a sequence's tokens", buckets=_ITL_BUCKETS, registry=r
        )

    def observe_engine(self, engine: Engine) -> None:
        s = engine.scheduler
        self.running.set(len(s.running))
        self.waiting.set(len(s.waiting))
        self.blocks_used.set(engine.pool.used)
        self.blocks_total.set(engine.pool.n_blocks)
        self.prefix_queried.set(s.prefix.queried)
        self.prefix_hit.set(s.prefix.hit)
        self.preemptions.set(s.preemptions)
        self.prompt_tokens.set(engine.stats.prompt_tokens)

    def text(self) -> bytes:
        return generate_latest(self.registry)
