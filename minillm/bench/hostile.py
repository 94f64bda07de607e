"""Does a hostile request stall the others? The inter-token latency of running streams while each is sent.

    python -m minillm serve --model gpt2 &
    python -m minillm.bench.hostile --base-url http://127.0.0.1:8000 --streams 16 --rounds 5

A server whose event loop does a request's work (building a million samples,
scanning 100,000 stop strings per token, tokenizing megabytes, writing a
35 MB answer) stops sending every other stream's tokens while it works. This
keeps `--streams` streams generating the whole time and, in each round, sends
each hostile request once, beside a quiet window of the same length; the
gaps between tokens that arrive during a window are its ITL.

    per attack    its status and how long its answer took
                  ITL p50 in its windows and in the quiet ones
                  the longest gap between two tokens of one stream in its window ÷ the quiet
                  window's of the same round: the median over rounds, with the interval the
                  rounds give (`verdict.median_interval`); a stall is one long gap among many
                  short ones, which the p50 hides

A ratio whose interval holds 1 (or lies below it) is "unchanged within the run's
spread"; one above it says the attack stalled the others, by that much. The
hostile requests are sized from the server's own `max_model_len` and
`max_num_seqs` is not known to a client, so `n` for the scoring attack is
`--scoring-n`. This is a measurement, not a test: its numbers belong under
`docs/` with the command and the machine.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx

from .verdict import median_interval


def attacks(max_model_len: int, scoring_n: int) -> dict[str, tuple[str, str, dict, dict]]:
    """name → (method, path, JSON body or None, headers)."""
    long_ids = list(range(1, max_model_len))
    return {
        "n=10^9": ("POST", "/v1/completions", {"prompt": "Hello", "n": 10**9, "max_tokens": 1}, {}),
        "n=10^6": ("POST", "/v1/completions", {"prompt": "Hello", "n": 10**6, "max_tokens": 1}, {}),
        "100k stop strings": ("POST", "/v1/completions",
                              {"prompt": "Hello", "stop": [f"s{i}" for i in range(100_000)], "max_tokens": 32}, {}),
        "3.6 MB text prompt": ("POST", "/v1/completions", {"prompt": "word " * 720_000, "max_tokens": 1}, {}),
        "10k prompts": ("POST", "/v1/completions", {"prompt": [[1]] * 10_000, "max_tokens": 1}, {}),
        f"echo+logprobs 20+n {scoring_n}": ("POST", "/v1/completions",
                                            {"prompt": long_ids, "echo": True, "logprobs": 20, "n": scoring_n,
                                             "max_tokens": 1}, {}),
        "Last-Event-ID: 5000 digits": ("GET", "/v1/engine/events", None, {"Last-Event-ID": "9" * 5000}),
    }


class Streams:
    """`count` streams kept running: each records the arrival time of every token event."""

    def __init__(self, client: httpx.AsyncClient, count: int, max_tokens: int):
        self.client, self.count, self.max_tokens = client, count, max_tokens
        self.arrivals: list[list[float]] = [[] for _ in range(count)]
        self.tasks: list[asyncio.Task] = []

    async def _run(self, i: int) -> None:
        body = {"prompt": [1, 2, 3, 4], "max_tokens": self.max_tokens, "ignore_eos": True, "stream": True}
        while True:  # one long request after another, so the stream never stops
            async with self.client.stream("POST", "/v1/completions", json=body, timeout=None) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data:"):
                        self.arrivals[i].append(time.perf_counter())

    def start(self) -> None:
        self.tasks = [asyncio.ensure_future(self._run(i)) for i in range(self.count)]

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    def gaps(self, start: float, end: float) -> list[float]:
        """Every gap between two consecutive tokens of one stream, both inside [start, end]."""
        out = []
        for times in self.arrivals:
            inside = [t for t in times if start <= t <= end]
            out += [b - a for a, b in zip(inside, inside[1:])]
        return out


async def window(client: httpx.AsyncClient, streams: Streams, seconds: float, attack=None) -> dict:
    """One window: send the attack (or nothing), wait at least `seconds`, and read the gaps inside it."""
    start, status, answered = time.perf_counter(), None, None
    if attack is not None:
        method, path, body, headers = attack  # body: JSON already encoded, so this client's loop stays free
        try:
            status = (await client.request(method, path, content=body, headers=headers, timeout=120)).status_code
        except httpx.HTTPError as e:  # no answer in 120 s: that is the finding
            status = type(e).__name__
        answered = time.perf_counter() - start
    await asyncio.sleep(max(0.0, seconds - (time.perf_counter() - start)))
    gaps = streams.gaps(start, time.perf_counter())
    return {"status": status, "answered_s": answered, "p50": statistics.median(gaps) if gaps else None,
            "max_gap": max(gaps, default=None)}


async def measure(base_url: str, streams: int, rounds: int, seconds: float, scoring_n: int,
                  only: list[str] | None = None) -> dict:
    async with httpx.AsyncClient(base_url=base_url, limits=httpx.Limits(max_connections=streams + 4)) as client:
        card = (await client.get("/v1/models")).json()["data"][0]
        max_model_len = card.get("max_model_len", 1024)
        hostile = {name: (method, path, None if body is None else json.dumps(body).encode(),
                          {**headers, **({"Content-Type": "application/json"} if body is not None else {})})
                   for name, (method, path, body, headers) in attacks(max_model_len, scoring_n).items()
                   if not only or any(word in name for word in only)}
        live = Streams(client, streams, max(1, max_model_len - 8))
        live.start()
        await asyncio.sleep(seconds)  # every stream past its prefill
        found = {name: [] for name in hostile}
        try:
            for k in range(rounds):
                names = list(hostile) if k % 2 == 0 else list(reversed(hostile))  # a moment's load hits both
                for name in names:
                    quiet = await window(client, live, seconds)
                    loud = await window(client, live, seconds, hostile[name])
                    found[name].append((quiet, loud))
        finally:
            await live.stop()
    return {"base_url": base_url, "streams": streams, "rounds": rounds, "window_s": seconds,
            "attacks": {name: summarize(pairs) for name, pairs in found.items()}}


def summarize(pairs: list[tuple[dict, dict]]) -> dict:
    """Per round, the attacked window's longest gap ÷ the quiet window's (a stall shows here: it is one long gap
    among many short ones, which leaves the p50 unmoved); the median over rounds and its interval."""
    ratios = [loud["max_gap"] / quiet["max_gap"] for quiet, loud in pairs if quiet["max_gap"] and loud["max_gap"]]
    mid = statistics.median(ratios) if ratios else float("nan")
    lo, hi, coverage = median_interval(ratios) if ratios else (float("nan"), float("nan"), 0.0)
    return {"status": sorted({loud["status"] for _, loud in pairs}, key=str),
            "answered_s": max(loud["answered_s"] for _, loud in pairs),  # the slowest answer
            "itl_p50_quiet_s": statistics.median(q["p50"] for q, _ in pairs if q["p50"]),
            "itl_p50_attacked_s": statistics.median(a["p50"] for _, a in pairs if a["p50"]),
            "ratio": mid, "ratio_interval": [lo, hi], "coverage": coverage, "rounds": len(ratios),
            "max_gap_s": max((a["max_gap"] or 0.0) for _, a in pairs),
            "max_gap_quiet_s": max((q["max_gap"] or 0.0) for q, _ in pairs),
            "reading": "unchanged within the run's spread" if lo <= 1.0 else f"stalls the others: longest gap "
                                                                            f"{mid:.1f}x the quiet window's"}


def print_report(result: dict) -> None:
    print(f"{result['streams']} streams at {result['base_url']}, {result['rounds']} rounds of "
          f"{result['window_s']:g} s windows; ratio: the attacked window's longest gap between two tokens of a "
          "stream ÷ the quiet window's, per round")
    print(f"{'attack':28} {'status':>7} {'answer':>9} {'ITL p50 quiet':>13} {'attacked':>9} {'longest gap quiet':>17} "
          f"{'attacked':>9} {'ratio [interval]':>20}  reading")
    for name, s in result["attacks"].items():
        lo, hi = s["ratio_interval"]
        print(f"{name:28} {','.join(map(str, s['status'])):>7} {s['answered_s'] * 1e3:7.0f}ms "
              f"{s['itl_p50_quiet_s'] * 1e3:11.1f}ms {s['itl_p50_attacked_s'] * 1e3:7.1f}ms "
              f"{s['max_gap_quiet_s'] * 1e3:15.0f}ms {s['max_gap_s'] * 1e3:7.0f}ms "
              f"{s['ratio']:6.2f} [{lo:.2f}, {hi:.2f}]  {s['reading']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--streams", type=int, default=16, help="streams kept generating the whole time")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--window", type=float, default=1.0, help="seconds of each quiet and each attacked window")
    p.add_argument("--scoring-n", type=int, default=16, help="n of the echo + logprobs attack (≤ its max_num_seqs)")
    p.add_argument("--only", nargs="+", default=None, metavar="WORD",
                   help="only the attacks whose name holds one of these (a server without limits may not survive "
                        "n=10^9: it builds every sample)")
    p.add_argument("--json", default=None, help="also write the result here")
    args = p.parse_args(argv)
    result = asyncio.run(measure(args.base_url, args.streams, args.rounds, args.window, args.scoring_n, args.only))
    print_report(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
