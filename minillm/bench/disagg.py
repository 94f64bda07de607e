"""Lesson 15's drivers: the stall trace and a saturating burst, served by worker processes (`serving/disaggregated.py`).

    stall_trace(workers, sizes, vocab)   K streams decode; once each has `warm` tokens a long prompt arrives;
                                         returns the streams' ITL in the window the long prompt's TTFT spans,
                                         their ITL before it, the long request's TTFT and its prefill/transfer split
    burst(workers, sizes, vocab)         `burst` requests at once; generated tokens over the makespan
    mixed_trace(workers, sizes, vocab, n)   the streams again, with `n` long prompts arriving evenly over their
                                         life: each request's TTFT and gaps, and the run's span, from which
                                         `goodput.goodput` counts the requests that met both targets

Both take any `Workers`, colocated or disaggregated, so one round of the
lesson serves the same requests through each, and times come from the
workers' own token records (one monotonic clock for every process on Linux).
"""
from __future__ import annotations

import statistics

import numpy as np

from .replay import greedy, percentile


def build_model(name: str, device: str, dtype: str):
    """The lesson's model inside a worker: the checkpoint if downloaded, else the seeded random init of its
    shape (the same values in every worker), quietly: the lesson said which once."""
    from ..checkpoints.load import load_model, locate, random_model
    from ..config import HF_CHECKPOINTS, PRESETS
    folder, preset = locate(name)
    if preset is not None and preset in HF_CHECKPOINTS and not folder.is_dir():
        return random_model(PRESETS[preset], device, dtype)
    return load_model(name, device, dtype)


def _serve(workers, requests: list[tuple[list[int], int]]) -> dict:
    """Add every request, step until all finish; returns the finished outputs by request id."""
    ids = [workers.add_request(prompt, greedy(n)) for prompt, n in requests]
    done = {}
    while workers.has_unfinished_requests():
        for out in workers.step():
            if out.finished:
                done[out.request_id] = out
    bad = {i: workers.failures.get(i, done[i].finish_reason) for i in ids if done[i].finish_reason != "length"}
    if bad:
        raise RuntimeError(f"requests did not run to their length: {bad}")
    return done


def stall_trace(workers, s: dict, vocab_size: int, seed: int = 0) -> dict:
    """The lesson-07 trace: `streams` short prompts decoding, then one long prompt once each has `warm` tokens."""
    rng = np.random.default_rng(seed)
    streams = [(rng.integers(0, vocab_size, s["stream_prompt"]).tolist(), s["stream_tokens"])
               for _ in range(s["streams"])]
    long_prompt = rng.integers(0, vocab_size, s["long_prompt"]).tolist()
    ids = [workers.add_request(p, greedy(n)) for p, n in streams]
    done, seen, long_id = {}, {}, None
    while workers.has_unfinished_requests():
        for out in workers.step():
            seen[out.request_id] = out
            if out.finished:
                done[out.request_id] = out
        if long_id is None and all(len(seen[i].output_token_ids) >= s["warm"] for i in ids if i in seen) \
                and len(seen) >= len(ids):
            long_id = workers.add_request(long_prompt, greedy(s["long_tokens"]))
    long = done[long_id].metrics
    arrival, first = long.arrival_time, long.token_times[0]
    gaps = [(a, b) for i in ids for a, b in zip(done[i].metrics.token_times, done[i].metrics.token_times[1:])]
    window = [b - a for a, b in gaps if b > arrival and a < first]
    before = [b - a for a, b in gaps if b <= arrival]
    prefilled = workers.prefilled_at.get(long_id)  # disaggregated: when the prefill worker sampled its first token
    return {"window_p99_itl_s": percentile(window, 99), "window_max_itl_s": max(window), "window_itls": len(window),
            "itl_before_median_s": statistics.median(before), "long_ttft_s": first - arrival,
            "long_prefill_s": None if prefilled is None else prefilled - arrival,
            "long_transfer_s": None if prefilled is None else first - prefilled}


def burst(workers, s: dict, vocab_size: int, seed: int = 1) -> dict:
    """`burst` requests arriving together: the saturating load at which throughput is compared."""
    rng = np.random.default_rng(seed)
    requests = [(rng.integers(0, vocab_size, s["burst_prompt"]).tolist(), s["burst_tokens"])
                for _ in range(s["burst"])]
    done = _serve(workers, requests)
    start = min(o.metrics.arrival_time for o in done.values())
    end = max(o.metrics.token_times[-1] for o in done.values())
    generated = sum(len(o.output_token_ids) for o in done.values())
    return {"generated": generated, "makespan_s": end - start, "throughput": generated / (end - start)}


def mixed_trace(workers, s: dict, vocab_size: int, n_long: int, seed: int = 2) -> dict:
    """`streams` short prompts decode `stream_tokens` each, and `n_long` long prompts arrive while they do, the
    i-th once every stream has made `warm + i·gap` tokens (gap spreads them evenly over the streams' life): the
    load mix, in long prompts per stream lifetime. Returns every gap between two consecutive tokens of a stream,
    every request's (TTFT, its gaps), and the span from the first arrival to the last token, in seconds."""
    rng = np.random.default_rng(seed)
    streams = [(rng.integers(0, vocab_size, s["stream_prompt"]).tolist(), s["stream_tokens"])
               for _ in range(s["streams"])]
    longs = [rng.integers(0, vocab_size, s["long_prompt"]).tolist() for _ in range(n_long)]
    gap = max(1, (s["stream_tokens"] - s["warm"]) // max(n_long, 1))
    marks = [s["warm"] + i * gap for i in range(n_long)]
    ids = [workers.add_request(p, greedy(n)) for p, n in streams]
    done, seen = {}, {}
    while workers.has_unfinished_requests():
        for out in workers.step():
            seen[out.request_id] = out
            if out.finished:
                done[out.request_id] = out
        made = min((len(seen[i].output_token_ids) if i in seen else 0) for i in ids)
        while marks and made >= marks[0]:
            marks.pop(0)
            workers.add_request(longs.pop(0), greedy(s["long_tokens"]))
    metrics = [o.metrics for o in done.values()]
    times = [done[i].metrics.token_times for i in ids]
    return {"gaps_s": [b - a for t in times for a, b in zip(t, t[1:])],
            "requests": [(m.token_times[0] - m.arrival_time, [b - a for a, b in zip(m.token_times, m.token_times[1:])])
                         for m in metrics],
            "span_s": max(m.token_times[-1] for m in metrics) - min(m.arrival_time for m in metrics)}
