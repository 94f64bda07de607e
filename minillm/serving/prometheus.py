"""What GET /metrics exports: the engine's gauges, and each finished request's record, in Prometheus' text.

The names are vLLM's, under `minillm:` instead of `vllm:`, so a dashboard or a
router built for one reads the other: the queue depth and KV use that llm-d's
model-server protocol asks of a server are `num_requests_waiting` and
`kv_cache_usage_perc`.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ..engine import RequestOutput
from .engine_loop import EngineLoop

BUCKETS_S = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]


class ServerMetrics:
    """One registry per server: gauges read from the engine loop's copies, counters fed by `record`."""

    def __init__(self, loop: EngineLoop):
        self.registry = r = CollectorRegistry()
        Gauge("minillm:num_requests_running", "Requests in the running batch", registry=r).set_function(
            lambda: loop.num_running)
        Gauge("minillm:num_requests_waiting", "Requests waiting for a slot", registry=r).set_function(
            lambda: loop.num_waiting)
        Gauge("minillm:kv_cache_usage_perc", "Share of KV blocks in use (0 to 1)", registry=r).set_function(
            lambda: loop.num_blocks_used / loop.num_blocks)
        self.prompt_tokens = Counter("minillm:prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("minillm:generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter("minillm:request_success", "Finished requests", ["finished_reason"], registry=r)
        self.rejected = Counter("minillm:request_rejected", "Requests refused", ["status"], registry=r)
        self.ttft = Histogram("minillm:time_to_first_token_seconds", "Arrival to first token, engine-side",
                              buckets=BUCKETS_S, registry=r)
        self.itl = Histogram("minillm:inter_token_latency_seconds", "Gap between two tokens, engine-side",
                             buckets=BUCKETS_S, registry=r)
        self.e2e = Histogram("minillm:e2e_request_latency_seconds", "Arrival to finish, engine-side",
                             buckets=BUCKETS_S, registry=r)

    def record(self, out: RequestOutput) -> None:
        """The engine's own record of a finished request, into the metrics (runs on the engine thread)."""
        m = out.metrics
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(sum(len(c.token_ids) for c in out.outputs))
        for c in out.outputs:  # one per sample: each is a sequence the engine ran to its own end
            self.finished.labels(c.finish_reason).inc()
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        for gap in m.itls:
            self.itl.observe(gap)
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
