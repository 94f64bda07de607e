"""Lesson 09: continuous batching. A request leaves the batch when it finishes, and a waiting one takes its seat.

The claim
---------
A static batch runs until its longest member finishes: a request that ends
early leaves its seat empty while the step still costs about a whole step
(lesson 04: decode is memory-bound). Orca's iteration-level scheduling, which
vLLM and this engine do, admits a waiting request at the next step instead
(`minillm/scheduler.py`). On a workload whose output lengths vary, at the same
maximum batch `max_num_seqs`, continuous batching serves at least 1.5× the output
tokens per second of static batching, with identical greedy tokens. Static
batching is run two ways: the engine's own static mode, on the same kernels
(`SchedulerConfig(batching_type="static")`, `minillm/static_batching.py`), and
transformers' padded `generate`, batch after batch, where installed (a CPU's --quick
leaves it to the full run: its loop is slower per step than the engine's).

The cost model, in steps (a step costs about the same whatever its batch):

    static steps     = Σ over batches of (1 prefill step + the batch's longest output − 1)
    continuous steps = the same requests, each seat refilled at the step after it frees
    predicted speedup = static steps ÷ continuous steps       (`bench/batching.py` counts both)

So the win grows with the spread of output lengths, none when all are equal (the control). The
workload: one request in `max_num_seqs` long, the rest short, the mean fixed; spread = long ÷ short.

And the memory wall: a KV pool of `pool_blocks` blocks holds at most pool_blocks ÷
blocks per sequence sequences at their longest (the knee, predicted before measuring).
Past it a higher `max_num_seqs` buys nothing: throughput flattens and preemptions
appear (the newest sequence gives its blocks back and is recomputed, `scheduler.py`).

What this lesson measures
-------------------------
Each workload served whole in each mode, in turns, for at least 5 rounds: tokens
per second, each request's end-to-end latency, each step's sampled tokens; then a
uniform workload through a small pool at rising `max_num_seqs`. A speedup is
judged round by round, and so is the mechanism: measured ÷ predicted ≥ 0.5 (a
step of fewer rows costs less, not nothing: static's near-empty tail is cheaper).
--quick on a CPU keeps the --model's width and vocabulary and one layer (said at
the start; "layers" in the JSON): the prediction counts steps, and holds while a
step costs the same whatever its batch (memory-bound: one gpt2 layer and its head
still read 186 MB in fp32); a host-bound shape (`mini`) pays per sequence and shows less.

Predict before you run: at max_num_seqs 8, with one request in 8 asking for
seven times the tokens of the others, how much faster is continuous batching?
"""
from __future__ import annotations

import random
import statistics

from common import make_parser, ms, plt, predict, print_table, run, save_plot, start, ticks_at, write_results
from minillm.bench.batching import finish_steps, long_and_short, padded_generate
from minillm.bench.gpu_targets import reference_model
from minillm.bench.replay import replay
from minillm.bench.verdict import MIN_ROUNDS, Check, Fact, interleave, judge, print_verdict, settled
from minillm.bench.workloads import Request
from minillm.checkpoints.load import random_model
from minillm.device import resolve_device
from minillm.engine import LLMEngine
from minillm.kv_pool import CacheConfig
from minillm.scheduler import SchedulerConfig

NAME = "09_continuous_batching"
SPEEDUP_LINE = 1.5   # continuous ÷ static output tokens/s on the mixed workload, at the same max_num_seqs
CONTROL_LINE = 1.2   # on the uniform workload the win vanishes: at most this
GROWTH_LINE = 1.2    # the widest spread's speedup ÷ the middle one's: the win grows
RISE_LINE = 1.5      # throughput at the knee ÷ at a quarter of it
MODEL_BAND = 0.5     # measured ÷ predicted speedup at least this: fewer rows make a step cheaper, not free
FLAT_LINE = 1.25     # throughput at 4× the knee ÷ at the knee: 4× the seats buy at most a quarter more
BLOCK_SIZE = 16
QUICK_CPU_LAYERS = 1  # --quick on a CPU: the --model's width and vocabulary, this many layers (tiny, the tests', stays)


def quick_layers(model: str, quick: bool, device) -> int | None:
    """The layers the run keeps: QUICK_CPU_LAYERS for --quick on a CPU, unless --model names tiny; else all (None)."""
    return QUICK_CPU_LAYERS if quick and resolve_device(device).type == "cpu" and model != "tiny" else None


def sizes(n_ctx: int, quick: bool) -> dict:
    seats, mean, n = (8, 6, 48) if quick else (8, 16, 48)  # decode steps a round, both modes: quick 365, full 1,099
    widest = min(mean - 2, (n_ctx - 16 - mean) // (seats - 1))  # long + a prompt of ≤ 16 stays in the context
    return {"requests": n, "max_num_seqs": seats, "mean": mean, "spreads": [0, widest // 3, widest],
            "knee": {"requests": 8 if quick else 16, "prompt": 16, "output": 8 if quick else 16, "pool_seqs": 4,
                     "max_num_seqs": [1, 2, 4, 8, 16]}}


def engine(model, mode: str, seats: int, blocks: int) -> LLMEngine:
    return LLMEngine(model, SchedulerConfig(max_num_batched_tokens=max(2048, seats * model.config.n_ctx),
                                            max_num_seqs=seats, enable_chunked_prefill=False, batching_type=mode),
                     CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks_override=blocks))


def serve(eng: LLMEngine, trace: list[Request]) -> dict:
    """The trace served whole: each request's tokens and end-to-end latency, and each step's sampled tokens."""
    first, r = len(eng.timeline), replay(eng, trace)
    return {"tokens": [r.outputs[str(i)].output_token_ids for i in range(len(trace))],
            "latency": [r.outputs[str(i)].metrics.finished_time - r.start for i in range(len(trace))],
            "per_step": [(x.start - r.start, x.num_sampled) for x in eng.timeline[first:]],
            "preemptions": r.preemptions, "steps": r.steps}


def reference(model):
    """transformers' GPT2LMHeadModel on our weights, never stopping at end-of-text (as `ignore_eos`); None if absent."""
    try:
        hf = reference_model(model, [0])[0]
    except ImportError:
        return None
    hf.generation_config.eos_token_id = None
    return hf


def measure_spreads(lesson, s: dict, hf) -> dict:
    """Each spread's workload in both modes (and transformers' on the widest), in turns, rounds added while undecided."""
    model, seats = lesson.model, s["max_num_seqs"]
    traces = {d: long_and_short(s["requests"], seats, s["mean"], d, lesson.config.vocab_size) for d in s["spreads"]}
    fns, judged = {}, s["spreads"][-1]
    for d, trace in traces.items():
        blocks = seats * -(-max(len(q.prompt) + q.max_tokens for q in trace) // BLOCK_SIZE)  # never preempts
        for mode in ("continuous", "static"):
            fns[f"{mode} {d}"] = (lambda e, t: lambda: serve(e, t))(engine(model, mode, seats, blocks), trace)
    if hf is not None:
        fns["transformers"] = lambda: padded_generate(hf, traces[judged], seats)

    def row(r, d: int, outs: list[int]) -> dict:
        cont, stat = (r.results(f"{m} {d}") for m in ("continuous", "static"))
        pc, ps = finish_steps(outs, seats, False), finish_steps(outs, seats, True)
        short = [i for i, o in enumerate(outs) if o <= statistics.median(outs)]
        return {"long": max(outs), "short": min(outs), "output_tokens": sum(outs),
                "predicted_continuous_steps": max(pc), "predicted_static_steps": max(ps),
                "predicted_speedup": max(ps) / max(pc), "predicted_short_latency_ratio":
                statistics.median(ps[i] for i in short) / statistics.median(pc[i] for i in short),
                "continuous_steps": cont[-1]["steps"], "static_steps": stat[-1]["steps"],
                "continuous_s": r.times(f"continuous {d}"), "static_s": r.times(f"static {d}"),
                "speedup": r.ratio(f"static {d}", f"continuous {d}"),
                "short_latency_ratio": [statistics.median(b["latency"][i] for i in short)
                                        / statistics.median(a["latency"][i] for i in short) for a, b in zip(cont, stat)],
                "requests_differing": sum(a != b for a, b in zip(cont[-1]["tokens"], stat[-1]["tokens"]))}

    def figures(r) -> dict:
        last = {m: r.results(f"{m} {judged}")[-1] for m in ("continuous", "static")}
        f = {"max_num_seqs": seats, "requests": s["requests"], "rounds": r.count, "transformers": None,
             "spreads": [row(r, d, [q.max_tokens for q in t]) for d, t in traces.items()],
             "per_step": {m: last[m]["per_step"] for m in last}, "latency": {m: last[m]["latency"] for m in last}}
        if hf is not None:
            gen = r.results("transformers")[-1]
            f["transformers"] = {"s": r.times("transformers"), "speedup": r.ratio("transformers", f"continuous {judged}"),
                                 "requests_differing": sum(a != b for a, b in zip(last["continuous"]["tokens"], gen["tokens"]))}
            f["latency"]["transformers"] = gen["latency"]
        return f
    return figures(interleave(fns, 5, device=lesson.device, desc="continuous against static",
                              until=settled(lambda r: spread_checks(figures(r)))))


def measure_knee(lesson, s: dict) -> dict:
    """A uniform workload through a pool of `pool_seqs` sequences' blocks at each max_num_seqs, in turns."""
    k = s["knee"]
    per_seq = -(-(k["prompt"] + k["output"] - 1) // BLOCK_SIZE)  # blocks of one sequence at its longest
    pool, tokens, rng = k["pool_seqs"] * per_seq, k["requests"] * k["output"], random.Random(1)
    trace = [Request([rng.randrange(lesson.config.vocab_size) for _ in range(k["prompt"])], k["output"])
             for _ in range(k["requests"])]
    fns = {str(b): (lambda e: lambda: serve(e, trace))(engine(lesson.model, "continuous", b, pool))
           for b in k["max_num_seqs"]}

    def figures(r) -> dict:
        return {"pool_blocks": pool, "blocks_per_sequence": per_seq, "predicted_knee": pool // per_seq,
                "prompt_blocks": -(-k["prompt"] // BLOCK_SIZE),
                "max_num_seqs": k["max_num_seqs"], "rounds": r.count,
                "throughput": [[tokens / t for t in r.times(str(b))] for b in k["max_num_seqs"]],
                "preemptions": [r.results(str(b))[-1]["preemptions"] for b in k["max_num_seqs"]],
                "predicted_steps": [max(finish_steps([k["output"]] * k["requests"], b, False)) for b in k["max_num_seqs"]]}
    return figures(interleave(fns, 5, device=lesson.device, desc="max_num_seqs",
                              until=settled(lambda r: knee_checks(figures(r)))))


def checks(figures: dict) -> list[Check]:
    """The verdict's checks, from the figures the lesson writes (pure: a test may pass any figures)."""
    return spread_checks(figures) + knee_checks(figures["knee"])


def spread_checks(f: dict) -> list[Check]:
    judged, middle, control = f["spreads"][-1], f["spreads"][1], f["spreads"][0]
    out = [
        Check(f"continuous ÷ static (engine) tokens/s, long {judged['long']} ÷ short {judged['short']}",
              judged["speedup"], SPEEDUP_LINE, ">=", fmt="{:.2f}", predicted=judged["predicted_speedup"],
              key="speedup", why=f"{judged['static_steps']} static steps against {judged['continuous_steps']}"),
        Check(f"that speedup ÷ the step model's {judged['predicted_speedup']:.2f}",
              [x / judged["predicted_speedup"] for x in judged["speedup"]], MODEL_BAND, ">=", fmt="{:.2f}",
              predicted=1.0, key="speedup_over_model", why=f"the model counts {judged['static_steps']} static steps "
              f"against {judged['continuous_steps']}, each as dear: static's near-empty ones cost less"),
        Check("requests whose greedy tokens differ, continuous against static", [judged["requests_differing"]],
              0, "<=", timed=False, fmt="{:.0f}", predicted=0, key="tokens", why=f"{judged['requests_differing']} requests differ"),
        Check("continuous ÷ static tokens/s on the uniform control", control["speedup"], CONTROL_LINE, "<=",
              fmt="{:.2f}", predicted=control["predicted_speedup"], key="control",
              why=f"{control['static_steps']} static steps against {control['continuous_steps']}"),
        Check(f"speedup at long ÷ short {judged['long']}/{judged['short']} over at {middle['long']}/{middle['short']}",
              [a / b for a, b in zip(judged["speedup"], middle["speedup"])], GROWTH_LINE, ">=", fmt="{:.2f}",
              predicted=judged["predicted_speedup"] / middle["predicted_speedup"], key="growth",
              why=f"predicted speedups {judged['predicted_speedup']:.2f} and {middle['predicted_speedup']:.2f}"),
        Check("short requests' median latency, static ÷ continuous", judged["short_latency_ratio"], SPEEDUP_LINE,
              ">=", fmt="{:.2f}", predicted=judged["predicted_short_latency_ratio"], key="short_latency",
              why=f"predicted from the steps at which they finish: {judged['predicted_short_latency_ratio']:.2f}")]
    if f["transformers"] is not None:
        hf = f["transformers"]
        out[1:1] = [Check("continuous ÷ transformers' padded generate tokens/s", hf["speedup"], SPEEDUP_LINE, ">=",
                          fmt="{:.2f}", predicted=judged["predicted_speedup"], key="speedup_transformers",
                          why=f"transformers took {ms(statistics.median(hf['s']))} a round"),
                    Check("requests whose greedy tokens differ, continuous against transformers",
                          [hf["requests_differing"]], 0, "<=", timed=False, fmt="{:.0f}", predicted=0,
                          key="tokens_transformers",
                          why=f"{hf['requests_differing']} requests differ")]
    return out


def knee_checks(kn: dict) -> list[Check]:
    at = {b: i for i, b in enumerate(kn["max_num_seqs"])}
    knee, low, far, steps = kn["predicted_knee"], kn["predicted_knee"] // 4, 4 * kn["predicted_knee"], kn["predicted_steps"]
    ratio = lambda a, b: [x / y for x, y in zip(kn["throughput"][at[a]], kn["throughput"][at[b]])]  # noqa: E731
    preempted = dict(zip(kn["max_num_seqs"], kn["preemptions"]))
    return [
        Check(f"tokens/s at max_num_seqs {knee} (the predicted knee) ÷ at {low}", ratio(knee, low), RISE_LINE, ">=",
              fmt="{:.2f}", predicted=steps[at[low]] / steps[at[knee]], key="knee_rise",
              why=f"{steps[at[low]]} and {steps[at[knee]]} steps predicted"),
        Check(f"tokens/s at max_num_seqs {far} ÷ at {knee}", ratio(far, knee), FLAT_LINE, "<=", fmt="{:.2f}",
              predicted=1.0, key="knee_flat", why=f"a pool of {kn['pool_blocks']} blocks holds {knee} sequences"),
        Check(f"preemptions at max_num_seqs ≤ {knee}", [sum(p for b, p in preempted.items() if b <= knee)], 0, "<=",
              timed=False, fmt="{:.0f}", predicted=0, key="knee_no_preemption", why=f"preemptions by max_num_seqs: {preempted}"),
        Check(f"preemptions at max_num_seqs {far}", [preempted[far]], 1, ">=", timed=False, fmt="{:.0f}",
              predicted=min(far, kn["pool_blocks"] // kn["prompt_blocks"]) - knee, key="knee_preemption",
              why=f"preemptions by max_num_seqs: {preempted}")]


def facts(f: dict) -> list[Fact]:
    j = f["spreads"][-1]
    return [Fact(f"engine steps, {m}", j[f"{m}_steps"], predicted=j[f"predicted_{m}_steps"], fmt="{:.0f}",
                 why="the schedule of a known workload: `finish_steps` counts it") for m in ("static", "continuous")]


def report(s: dict, f: dict) -> None:
    rows = [[f"{x['long']}/{x['short']}", x["output_tokens"], x["predicted_static_steps"], x["static_steps"],
             x["predicted_continuous_steps"], x["continuous_steps"], ms(statistics.median(x["static_s"])),
             ms(statistics.median(x["continuous_s"])), f"{x['predicted_speedup']:.2f}",
             f"{statistics.median(x['speedup']):.2f}"] for x in f["spreads"]]
    print_table(["long/short", "tokens", "static steps (pred)", "static steps", "cont steps (pred)", "cont steps",
                 "static", "continuous", "speedup (pred)", "speedup"], rows,
                f"{s['requests']} requests at max_num_seqs {s['max_num_seqs']} (medians of {f['rounds']} rounds):")
    kn = f["knee"]
    print_table(["max_num_seqs", "tokens/s", "preemptions", "steps (pred, no pool limit)"],
                [[b, f"{statistics.median(t):.0f}", p, st] for b, t, p, st in
                 zip(kn["max_num_seqs"], kn["throughput"], kn["preemptions"], kn["predicted_steps"])],
                f"A uniform workload through a pool of {kn['pool_blocks']} blocks ({kn['blocks_per_sequence']} a "
                f"sequence: the knee at {kn['predicted_knee']}):")
    if f["transformers"] is None:
        print("static batching judged on the engine's static mode alone (transformers absent, or a CPU's --quick)\n")


def plot(lesson, f: dict, verdict) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2))
    j = f["spreads"][-1]
    for mode, color in (("static", "C3"), ("continuous", "C0")):
        t, n = zip(*f["per_step"][mode])
        axes[0].step(t, n, where="post", color=color, lw=1, label=f"{mode}: {len(t)} steps")
    axes[0].set(xlabel="seconds since the trace started (the last round)", ylabel="tokens sampled in the step",
                title=f"tokens per step, long {j['long']} ÷ short {j['short']}, max_num_seqs {f['max_num_seqs']}")
    axes[0].legend(fontsize=8)
    kn, mid = f["knee"], [statistics.median(t) for t in f["knee"]["throughput"]]
    axes[1].plot(kn["max_num_seqs"], mid, "o-", label="tokens/s (median of the rounds)")
    axes[1].axvline(kn["predicted_knee"], color="k", ls=":", label=f"predicted knee: {kn['predicted_knee']}")
    for b, y, p in zip(kn["max_num_seqs"], mid, kn["preemptions"]):
        axes[1].annotate(f"{p} preempted", (b, y), fontsize=7, textcoords="offset points", xytext=(0, 6))
    axes[1].set_xscale("log", base=2)
    ticks_at(axes[1], kn["max_num_seqs"])
    axes[1].set(xlabel="max_num_seqs", ylabel="output tokens/s", ylim=(0, 1.2 * max(mid)),
                title=f"the memory wall: a pool of {kn['pool_blocks']} blocks")
    axes[1].legend(fontsize=8)
    for mode, lat in f["latency"].items():
        xs = sorted(lat)
        axes[2].step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=mode)
    axes[2].set(xlabel="end-to-end latency (s, the last round)", ylabel="share of requests",
                title="latency CDF: every request arrives at once")
    axes[2].legend(fontsize=8)
    save_plot(lesson, fig, verdict)


def main(argv=None) -> dict:
    args = make_parser(__doc__).parse_args(argv)
    layers = quick_layers(args.model, args.quick, args.device)
    lesson = start(NAME, args, ceilings=False)
    if layers is not None and layers < (cfg := lesson.config).n_layer:
        lesson.model = random_model(cfg.with_(n_layer=layers), lesson.device, lesson.dtype)
        print(f"--quick on a CPU: {args.model}'s width and vocabulary, {layers} of its {cfg.n_layer} layers: a step still "
              f"reads {lesson.config.weight_bytes(lesson.dtype) / 1e6:.0f} MB, memory-bound (all: without --quick)\n")
    s = sizes(lesson.config.n_ctx, args.quick)
    seats, kn = s["max_num_seqs"], s["knee"]
    outs = [r.max_tokens for r in long_and_short(s["requests"], seats, s["mean"], s["spreads"][-1], 1)]
    static, cont = max(finish_steps(outs, seats, True)), max(finish_steps(outs, seats, False))
    per_seq = -(-(kn["prompt"] + kn["output"] - 1) // BLOCK_SIZE)
    predict(lesson, f"{s['requests']} requests, one in {seats} long: static batching takes {static} steps, continuous "
            f"{cont}: {static / cont:.2f}× the tokens/s if a step costs the same whatever its batch; none on the control",
            f"a pool of {kn['pool_seqs'] * per_seq} blocks at {per_seq} blocks a sequence: throughput stops rising "
            f"at max_num_seqs {kn['pool_seqs']}, and preemptions start past it")
    steps = sum(max(finish_steps([r.max_tokens for r in long_and_short(s["requests"], seats, s["mean"], d, 1)], seats, m))
                for d in s["spreads"] for m in (True, False))
    print(f"this run: {steps} engine steps a round over the spreads (both modes), at least {MIN_ROUNDS} rounds, then the "
          "knee, each with a progress bar (in full, on gpt2's shape on a CPU: minutes)\n")
    hf = reference(lesson.model) if layers is None else None  # quick on a CPU: generate's loop would be half the run
    figures = measure_spreads(lesson, s, hf)
    figures["knee"], figures["layers"] = measure_knee(lesson, s), lesson.config.n_layer
    report(s, figures)
    verdict = judge(f"at max_num_seqs {seats}, continuous batching serves ≥ {SPEEDUP_LINE}× the tokens/s of static "
                    "batching on mixed output lengths, with the same tokens; the win grows with the spread, vanishes "
                    "when all are equal, and stops at the KV pool's knee", checks(figures), lesson.load(),
                    facts=facts(figures))
    print_verdict(verdict)
    plot(lesson, figures, verdict)
    write_results(lesson, figures, verdict)
    return {"figures": figures, "verdict": verdict}


if __name__ == "__main__":
    run(main)
