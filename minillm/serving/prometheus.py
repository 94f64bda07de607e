"""What GET /metrics exports: the engine's gauges, and each finished request's record, in Prometheus' text.

Each figure is exported twice. Under vLLM's own names, types and labels
(`vllm:`, labelled `model_name` and `engine`), so a dashboard, `vllm bench
serve`'s reader or llm-d's router built for vLLM reads this server unchanged:
the queue depth and KV use that llm-d's model-server protocol asks of a server
are `vllm:num_requests_waiting` and `vllm:kv_cache_usage_perc`. And under the
same names with `minillm:` (no labels), which the lessons and the live page read.

    gauges, read when scraped     running and waiting requests, KV blocks in use (0 to 1)
    counters and histograms       fed on the engine thread by each finished request's own record:
                                  tokens, finish reasons, preemptions, prefix-cache queries and hits
                                  (in prompt tokens), and its phases: queue (arrival → first
                                  scheduled), prefill (→ first token), decode (→ last token),
                                  TTFT, the gaps between tokens, end to end

Counted when a request finishes, not step by step: a scrape mid-request sees its
preemptions and cache hits once it ends. The engine served here does not
speculate, so vLLM's `spec_decode` counters are not exported rather than
exported as zeros.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ..engine import RequestOutput
from .engine_loop import EngineLoop

BUCKETS_S = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]
# vLLM's own buckets, so that its dashboards' quantiles read the same
VLLM_TTFT_S = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0, 160.0, 640.0, 2560.0]
VLLM_ITL_S = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
              80.0]
VLLM_REQUEST_S = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                  480.0, 960.0, 1920.0, 7680.0]
LABELS = ["model_name", "engine"]  # vLLM's: the served model, and the engine's index (one engine here: "0")


class ServerMetrics:
    """One registry per server: gauges read from the engine loop's copies, counters fed by `record`."""

    def __init__(self, loop: EngineLoop, model_name: str = "minillm"):
        self.registry = r = CollectorRegistry()
        label = {"model_name": model_name, "engine": "0"}

        def gauge(name: str, doc: str, read) -> None:
            Gauge(f"minillm:{name}", doc, registry=r).set_function(read)
            Gauge(f"vllm:{name}", doc, LABELS, registry=r).labels(**label).set_function(read)

        def both(kind, name: str, doc: str, vllm_buckets=None, labels=()):
            ours = kind(f"minillm:{name}", doc, list(labels), registry=r,
                        **({"buckets": BUCKETS_S} if kind is Histogram else {}))
            theirs = kind(f"vllm:{name}", doc, LABELS + list(labels), registry=r,
                          **({"buckets": vllm_buckets} if kind is Histogram else {}))
            if labels:
                return lambda *values: (ours.labels(*values), theirs.labels(model_name, "0", *values))
            return ours, theirs.labels(**label)

        gauge("num_requests_running", "Requests in the running batch", lambda: loop.num_running)
        gauge("num_requests_waiting", "Requests waiting for a slot", lambda: loop.num_waiting)
        gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
              lambda: loop.num_blocks_used / loop.num_blocks)
        self.prompt_tokens = both(Counter, "prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = both(Counter, "generation_tokens", "Tokens generated")
        self.finished = both(Counter, "request_success", "Finished requests (each sample)", labels=["finished_reason"])
        self.preemptions = both(Counter, "num_preemptions", "Preemptions, counted when their request finishes")
        self.prefix_queries = both(Counter, "prefix_cache_queries", "Prefix cache queries, in prompt tokens")
        self.prefix_hits = both(Counter, "prefix_cache_hits", "Prefix cache hits, in cached prompt tokens")
        self.rejected = Counter("minillm:request_rejected", "Requests refused", ["status"], registry=r)
        self.ttft = both(Histogram, "time_to_first_token_seconds", "Arrival to first token, engine-side",
                         VLLM_TTFT_S)
        self.itl = both(Histogram, "inter_token_latency_seconds", "Gap between two tokens, engine-side", VLLM_ITL_S)
        self.e2e = both(Histogram, "e2e_request_latency_seconds", "Arrival to finish, engine-side", VLLM_REQUEST_S)
        self.queue = both(Histogram, "request_queue_time_seconds", "Time in WAITING: arrival to first scheduled",
                          VLLM_REQUEST_S)
        self.prefill = both(Histogram, "request_prefill_time_seconds", "Time in PREFILL: first scheduled to first "
                                                                         "token", VLLM_REQUEST_S)
        self.decode = both(Histogram, "request_decode_time_seconds", "Time in DECODE: first token to last token",
                           VLLM_REQUEST_S)

    def record(self, out: RequestOutput) -> None:
        """The engine's own record of a finished request, into the metrics (runs on the engine thread)."""
        m = out.metrics

        def add(pair, value: float, observe: bool = False) -> None:
            for metric in pair:
                metric.observe(value) if observe else metric.inc(value)

        add(self.prompt_tokens, len(out.prompt_token_ids))
        add(self.generation_tokens, sum(len(c.token_ids) for c in out.outputs))
        add(self.preemptions, out.num_preemptions)
        if out.num_cached_tokens is not None:  # admitted: its prompt was looked up in the prefix cache
            add(self.prefix_queries, len(out.prompt_token_ids))
            add(self.prefix_hits, out.num_cached_tokens)
        for c in out.outputs:  # one per sample: each is a sequence the engine ran to its own end
            add(self.finished(c.finish_reason), 1)
        if m.ttft is not None:
            add(self.ttft, m.ttft, observe=True)
        for gap in m.itls:
            add(self.itl, gap, observe=True)
        if m.finished_time is not None:
            add(self.e2e, m.finished_time - m.arrival_time, observe=True)
        if m.first_scheduled_time is not None:
            add(self.queue, m.first_scheduled_time - m.arrival_time, observe=True)
            if m.first_token_time is not None:
                add(self.prefill, m.first_token_time - m.first_scheduled_time, observe=True)
                add(self.decode, m.token_times[-1] - m.first_token_time, observe=True)
