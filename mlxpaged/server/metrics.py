"""`/metrics` in Prometheus text format: the engine's gauges and counters, latency histograms.

Gauges and counters are read from the engine loop's `snapshot` (taken by the engine thread
after each step), so a scrape never touches the engine itself. `mlxpaged_kv_blocks_used`
counts blocks with a reference count above zero; cached, evictable blocks are free.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

GAUGES = {
    "requests_running": "Requests with at least one sample scheduled.",
    "requests_waiting": "Requests queued for admission.",
    "requests_held": "Requests the engine still tracks (a finished one is dropped once reported): 0 when idle.",
    "sinks_held": "HTTP requests the engine loop still routes outputs to: 0 when idle.",
    "kv_blocks_used": "KV blocks with a reference count above zero.",
    "kv_blocks_total": "KV blocks in the pool.",
    "mlx_active_memory_bytes": "MLX active memory after the last step.",
    "mlx_peak_memory_bytes": "MLX peak memory since start.",
    "mlx_cache_memory_bytes": "Freed MLX buffers kept for reuse (emptied whenever the engine goes idle).",
}
COUNTERS = {
    "preemptions": "Requests preempted for lack of blocks.",
    "generation_tokens": "Tokens generated.",
    "spec_proposed_tokens": "Speculative decoding: tokens proposed and verified.",
    "spec_accepted_tokens": "Speculative decoding: proposed tokens accepted.",
    "prompt_tokens_computed": "Prompt tokens run through the model (cancelled requests' and recomputed ones included).",
    "prompt_tokens_cached": "Prompt tokens taken from the prefix cache (memory or disk) instead of computed.",
}
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class _EngineCollector:
    def __init__(self, engine_loop):
        self.engine_loop = engine_loop

    def collect(self):
        snap = self.engine_loop.snapshot
        for key, doc in GAUGES.items():
            yield GaugeMetricFamily(f"mlxpaged_{key}", doc, value=snap.get(key, 0))
        for key, doc in COUNTERS.items():
            yield CounterMetricFamily(f"mlxpaged_{key}", doc, value=snap.get(key, 0))  # exposed as *_total
        # One family split by where the blocks came from: the pool ("memory") or the disk tier.
        hits = CounterMetricFamily(
            "mlxpaged_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache.", labels=["tier"]
        )
        disk = snap.get("prefix_cache_disk_hit_tokens", 0)
        hits.add_metric(["memory"], snap.get("prefix_cache_hit_tokens", 0) - disk)
        hits.add_metric(["disk"], disk)
        yield hits


class Metrics:
    """One registry per server; also the engine loop's latency observer."""

    def __init__(self, engine_loop=None):
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes etc. (Linux)
        self.ttft = Histogram(
            "mlxpaged_time_to_first_token_seconds",
            "Time from arrival to the first token.",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "mlxpaged_inter_token_latency_seconds",
            "Time between two tokens of one sample.",
            buckets=ITL_BUCKETS,
            registry=self.registry,
        )
        if engine_loop is not None:
            self.attach(engine_loop)

    def attach(self, engine_loop) -> None:
        self.registry.register(_EngineCollector(engine_loop))

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
