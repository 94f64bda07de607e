"""Lesson 03: launch overhead. A small model waits on its host, a large one on memory.

The claim
---------
Before a decode step moves any data, the host pays for every op it dispatches:
Python, the module call, PyTorch's dispatcher and, on a GPU, a kernel launch,
a few µs each (c). And every weight must be read once. So a step costs about

    CPU:  t(step) ≈ ops · c + weight bytes / read rate       (the same cores do both: the terms add)
    GPU:  t(step) ≈ max(ops · c, weight bytes / read rate)   (the host queues kernels while the GPU runs)

The ops grow with the depth only (about 32 per layer, `metrics.count_ops`),
the bytes with depth × width² and the vocabulary. So decode of a small model
is bound by per-op host overhead, a large model's by memory; somewhere in
between they cross. On a big GPU that sits far up: at an H200's 4.8 TB/s
(datasheet), gpt2's ~380 ops at 5 µs each take as long as reading 9 GB, more
than gpt2-xl's weights. CUDA graphs (`minillm/cuda_graphs.py`) replay a
step's kernels with one launch and so remove the ops · c term.

What this lesson measures
-------------------------
For each GPT-2 shape from `tiny` up to `--model` (at least two), a batch-1
decode step after 16 tokens (64 full): its ops, counted (eager; static, the
step a CUDA graph replays); its time, eager and static (and as a graph on
CUDA); its twin's: the same depth at width 8, vocabulary 16, the same ops on
matrices of a few hundred bytes: the host's cost of the ops (÷ ops: c). In
turns of ≥ 10 ms of steps (30 ms full), 5 rounds (9 full), one torch thread.

The prediction, before the ladder is timed: c from the smallest shape's twin,
each shape's ops counted on its twin, its weights at the read rate of the
engine's one-row product (timed with the ceilings, on a CPU on one thread, as
the steps run): the formula gives each step's time and overhead share.

The verdict, round by round: the overhead share (twin ÷ eager step) is ≥ 1/2
for the smallest shape and ≤ 1/2 for the largest (undecided where the formula
predicts that one overhead-bound too), so the crossover lies inside the
ladder, and the lesson names where; and the mechanism: the largest shape's
step ÷ the formula's time (its twin's + weight bytes ÷ read rate) is within
2× either way, the formula's own uncertainty: the model's products have other
shapes than the one timed, and read at ½–2× its rate (slower for short rows,
faster where a matrix fits a cache); past that lies a cost it leaves out, or
a read rate that is not the step's. On CUDA,
where the engine decodes with graphs, the shares judged are the graph step's
(twin replayed ÷ shape replayed), and the smallest shape's graph step takes
≤ 1/2 of its eager step; on the CPU what a replay would remove (static ops ×
c) is a fact, computed, not measured.

Predict before you run: how many µs does one op cost here? How many MB of
weights take as long to read as gpt2's ops take to dispatch?
"""
from __future__ import annotations

import contextlib
import dataclasses
import statistics

from common import make_parser, ms, one_thread, plt, predict, print_table, run, save_plot, si, start, write_results
import torch  # after common, which imports minillm: OpenMP's wait policy is set before torch loads it
from minillm.bench.verdict import Check, Fact, interleave, judge, print_verdict, settled
from minillm.config import PRESETS
from minillm.bench.cost import weight_read_floor
from minillm.bench.steps import count_ops, decode_step
from minillm.bench.timing import time_fn
from minillm.checkpoints.load import random_model

NAME = "03_launch_overhead"
OVERHEAD_BOUND = 0.5  # overhead share ≥ this: the host's cost of the ops is at least half the step
GRAPH_GAIN = 0.5      # on CUDA: the smallest shape's graph step ≤ this × its eager step
MODEL_BAND = 2.0      # the largest shape's step within this factor of the formula's, either way
SIZES = {True: {"context": 16, "rounds": 5, "turn_s": 0.01}, False: {"context": 64, "rounds": 9, "turn_s": 0.03}}


def ladder(model_name: str, params: int) -> list[str]:
    """The presets smaller than the lesson's model, then the model itself (at least two shapes, in size order)."""
    by_size = sorted((n for n in PRESETS if n != "distilgpt2"), key=lambda n: PRESETS[n].num_params())  # half a gpt2
    names = [n for n in by_size if PRESETS[n].num_params() < params and n != model_name] + [model_name]
    return names if len(names) > 1 else names + [next(n for n in by_size if PRESETS[n].num_params() > params)]


def read_rate(lesson) -> float:
    """Bytes/s the engine's one-row product (a batch-1 step's kernel) read, timed with the ceilings; on CUDA the
    bandwidth (there that timing is a loop of launches: the ops · c the formula counts apart)."""
    return lesson.ceilings.kernels["one-row product"]["rate"] if lesson.device.type == "cpu" else lesson.ceilings.bandwidth


def twin_of(config):
    """The same depth, hence the same ops, on matrices of a few hundred bytes: a step that is all host cost."""
    return dataclasses.replace(config, n_head=1, n_embd=8, vocab_size=16, eos_token_id=None)


def bound(share: float) -> str:
    return "overhead" if share >= OVERHEAD_BOUND else "memory"


def crossover(points: list[dict]) -> str:
    """Where the ladder turns from overhead-bound to memory-bound, in words, from the median shares."""
    label = lambda p: f"{p['name']} ({si(p['weight_bytes'], 'B')}, share {p['share_median']:.2f})"  # noqa: E731
    kinds = [bound(p["share_median"]) for p in points]
    if "memory" not in kinds:
        return f"every shape up to {label(points[-1])} is overhead-bound: the crossover lies above it"
    if "overhead" not in kinds:
        return f"every shape from {label(points[0])} on is memory-bound: the crossover lies below it"
    if not (turns := [i for i in range(1, len(points)) if kinds[i - 1] == "overhead" and kinds[i] == "memory"]):
        return "the shapes do not turn from overhead- to memory-bound as they grow: " + ", ".join(map(label, points))
    return f"the crossover lies between {label(points[turns[0] - 1])} and {label(points[turns[0]])}"


def even_bytes(overhead_s: float, step_s: float, weight_bytes: float) -> float | None:
    """The weight bytes read in the ops' host time at this shape's own read rate; None if all overhead."""
    return None if step_s <= overhead_s else overhead_s * weight_bytes / (step_s - overhead_s)


def step_model(ops: int, c: float, weight_bytes: float, bandwidth: float, on_cuda: bool) -> float:
    return max(ops * c, weight_bytes / bandwidth) if on_cuda else ops * c + weight_bytes / bandwidth  # the formula


def measure(model, name: str, s: dict, bandwidth: float, side: str | None = None) -> dict:
    """One shape: ops, step times by mode and of its twin, in turns; the overhead share round by round (with
    `side`, rounds added while the judged share straddles its line on that side)."""
    cfg, device = model.config, model.device
    modes = ["eager", "static"] + (["graph"] if device.type == "cuda" else [])
    steps = {m: decode_step(model, s["context"], 1, mode=m) for m in modes}
    twin = random_model(twin_of(cfg), device, model.dtype)
    steps["twin"] = decode_step(twin, s["context"], 1)
    if "graph" in modes:  # the twin replayed too: what a graph step costs whatever its bytes
        steps["twin graph"] = decode_step(twin, s["context"], 1, mode="graph")
    ops = {m: count_ops(f) for m, f in steps.items()}
    k = {m: max(1, round(s["turn_s"] / time_fn(f, device, warmup=1, repeats=3).median_s))  # steps per turn ≥ turn_s:
         for m, f in steps.items()}                                                       # one short step is noise
    a, b = ("twin graph", "graph") if "graph" in modes else ("twin", "eager")  # the judged share: a ÷ b
    judged = lambda r: [Check("share", [x / k[a] / (y / k[b]) for x, y in zip(r.times(a), r.times(b))],  # noqa: E731
                              OVERHEAD_BOUND, side)] if side else []  # none: no rounds added
    rounds = interleave({m: lambda f=f, n=k[m]: [f() for _ in range(n)] for m, f in steps.items()}, s["rounds"],
                        device=device, desc=f"{name}: steps and twin, in turns", until=settled(judged))
    times = {m: [t / k[m] for t in rounds.times(m)] for m in steps}
    per_op = [t / ops["twin"].total for t in times["twin"]]
    share = [c * ops["eager"].total / t for c, t in zip(per_op, times["eager"])]
    point = {"name": name, "rounds": rounds.count, "params": cfg.num_params(), "weight_bytes": cfg.weight_bytes(model.dtype),
             "floor_s": weight_read_floor(cfg, model.dtype, bandwidth), "ops": {m: o.total for m, o in ops.items()},
             "kernels": {m: o.kernels for m, o in ops.items()}, "steps_per_turn": k, "times_s": times,
             "step_s": {m: statistics.median(v) for m, v in times.items()},
             "host_per_op_s": statistics.median(per_op), "share": share, "share_median": statistics.median(share)}
    point["overhead_s"] = point["host_per_op_s"] * ops["eager"].total
    point["graph_removes_s"] = point["host_per_op_s"] * ops["static"].total  # what one replay saves: a prediction
    if "graph" in modes:
        point["graph_over_eager"] = [g / e for g, e in zip(times["graph"], times["eager"])]
        point["graph_share"] = [t / g for t, g in zip(times["twin graph"], times["graph"])]
    return point


def predict_ladder(lesson, names: list[str], s: dict, bare: float) -> dict:
    """Before the ladder is timed: c from the smallest shape's twin; each shape's ops, and by the formula its share."""
    bandwidth, on_cuda, dtype = read_rate(lesson), lesson.device.type == "cuda", lesson.dtype
    cfgs = {n: PRESETS[n] if n in PRESETS else lesson.config for n in names}
    twins = {n: decode_step(random_model(twin_of(cfg), lesson.device, dtype), s["context"], 1) for n, cfg in cfgs.items()}
    ops = {n: count_ops(t).total for n, t in twins.items()}
    c = time_fn(twins[names[0]], lesson.device, warmup=2, repeats=7).median_s / ops[names[0]]
    step = {n: step_model(ops[n], c, cfgs[n].weight_bytes(dtype), bandwidth, on_cuda) for n in names}
    share = {n: ops[n] * c / step[n] for n in names}
    predict(lesson, f"one op costs the host {c * 1e6:.1f} µs ({names[0]}'s twin; a bare add {bare * 1e6:.1f} µs), a "
            f"step's weights their bytes ÷ the one-row product's read rate, {si(bandwidth, 'B/s')}: " + ", ".join(
                f"{n} {ops[n]} ops + {ms(cfgs[n].weight_bytes(dtype) / bandwidth)}" for n in names),
            expect={"small_share": share[names[0]], "large_share": share[names[-1]], "large_step_over_model": 1.0,
                    **({"graph_gain": cfgs[names[0]].weight_bytes(dtype) / bandwidth / step[names[0]]}
                       if on_cuda else {})})
    return {"host_per_op_s": c, "step_s": step, "share": share}


def print_ladder(lesson, s: dict, points: list[dict]) -> None:
    modes = [m for m in points[0]["step_s"] if m != "twin graph"]
    print_table(["shape", "rounds", "weights", "ops " + "/".join(m for m in modes if m != "twin"),
                 *[f"step {m}" for m in modes], "µs/op", "floor", "floor ÷ eager", "overhead share", "bound"],
                [[p["name"], p["rounds"], si(p["weight_bytes"], "B"),
                  "/".join(str(p["ops"][m]) for m in modes if m != "twin"),
                  *[ms(p["step_s"][m]) for m in modes], f"{p['host_per_op_s'] * 1e6:.1f}", ms(p["floor_s"]),
                  f"{p['floor_s'] / p['step_s']['eager']:.0%}", f"{p['share_median']:.2f}", bound(p["share_median"])]
                 for p in points],
                f"Batch-1 decode after {s['context']} tokens, {str(lesson.dtype).removeprefix('torch.')} (medians of "
                "each shape's rounds; twin = the same ops at width 8; share = twin ÷ eager step):")


def checks(figures: dict) -> list[Check]:
    """Overhead shares on each side of the line (on CUDA the graph step's, and its gain); the formula's band."""
    small, large, on_cuda, pred = figures["points"][0], figures["points"][-1], figures["on_cuda"], figures["predicted"]

    def why(p) -> str:
        return (f"{p['name']}'s twin (its {p['ops']['eager']} ops at width 8, almost no bytes) took "
                f"{ms(p['step_s']['twin'])} of its {ms(p['step_s']['eager'])} eager step, while reading its "
                f"{si(p['weight_bytes'], 'B')} of weights at the one-row product's rate takes {ms(p['floor_s'])}")

    share, step = ("graph_share", "graph step, as the engine runs it on CUDA") if on_cuda else ("share", "step")
    over = [t / step_model(1, tw, large["floor_s"], 1.0, on_cuda)  # the formula, c · ops measured as its twin
            for t, tw in zip(large["times_s"]["eager"], large["times_s"]["twin"])]
    name = f"{large['name']}'s eager step ÷ {'max' if on_cuda else 'sum'}(its twin, weight bytes ÷ read rate)"
    took = (f"{large['name']}'s step took {ms(large['step_s']['eager'])} where its ops' host time (its twin, "
            f"{ms(large['step_s']['twin'])}) and its weights at the read rate ({ms(large['floor_s'])}) give ")
    out = [Check(f"overhead share of {small['name']}'s {step}", small[share], OVERHEAD_BOUND, ">=", fmt="{:.2f}",
                 predicted=pred["share"][small["name"]], key="small_share",
                 why=why(small) + ": the host's work is not what sets this step's pace"),
           Check(f"overhead share of {large['name']}'s {step}", large[share], OVERHEAD_BOUND, "<=", fmt="{:.2f}",
                 predicted=pred["share"][large["name"]], key="large_share",
                 why=why(large) + ": its ops cost the host more than its bytes cost the memory",
                 undecided="" if pred["share"][large["name"]] < OVERHEAD_BOUND else (
                     f"the formula predicted {large['name']} overhead-bound too (share "
                     f"{pred['share'][large['name']]:.2f}): this ladder has no memory-bound shape to judge; "
                     "pass a larger --model (gpt2)")),
           Check(name, over, MODEL_BAND, "<=", fmt="{:.2f}", predicted=1.0, key="large_step_over_model",
                 why=took + "less than half of it: a cost the formula leaves out"),
           Check(name, over, 1 / MODEL_BAND, ">=", fmt="{:.2f}", predicted=1.0, key="large_step_over_model_low",
                 why=took + "more than twice it: the step read its weights faster than the rate it was predicted at")]
    if on_cuda:
        out.append(Check(f"{small['name']}: graph step ÷ eager step", small["graph_over_eager"], GRAPH_GAIN, "<=",
                         fmt="{:.2f}", predicted=small["floor_s"] / pred["step_s"][small["name"]], key="graph_gain",
                         why=f"graph {ms(small['step_s']['graph'])} against eager {ms(small['step_s']['eager'])}, "
                             f"with {ms(small['graph_removes_s'])} of host time predicted saved: the replay "
                             "removed less host time than its ops cost"))
    return out


def facts(figures: dict) -> list[Fact]:
    """What cannot refute the claim: each twin's ops (its shape's, by construction), off CUDA a graph's saving."""
    return [Fact(f"ops per step of {p['name']} and of its twin", p["ops"]["twin"], fmt="{:.0f}", why="the same by "
                 "construction (a test holds it): what makes the twin's time the host's cost") for p in figures["points"]
            ] + [Fact(f"what a CUDA graph would save {p['name']}'s step (static ops × µs/op)", p["graph_removes_s"] * 1e3,
                      fmt="{:.3g} ms", why=f"computed, not measured: no CUDA here (its static step took "
                      f"{ms(p['step_s']['static'])})") for p in figures["points"] if not figures["on_cuda"]]


def judge_claim(lesson, figures: dict, bare: float):
    """The checks and the facts; notes on where host time and bytes cross; returns the verdict, the bytes at evens."""
    points, on_cuda, bandwidth, large = figures["points"], figures["on_cuda"], read_rate(lesson), figures["points"][-1]
    verdict = judge("decode of a small model is bound by per-op host overhead, a large model's by memory",
                    checks(figures), lesson.load(), facts=facts(figures))
    verdict.notes.append(crossover(points) + f"; one op costs the host {large['host_per_op_s'] * 1e6:.1f} µs in a "
                         f"step of {large['name']} ({large['ops']['eager']} ops), a bare `x.add_(1)` "
                         f"{bare * 1e6:.1f} µs: the rest is Python and module calls")
    even = even_bytes(large["overhead_s"], large["step_s"]["eager"], large["weight_bytes"])
    if even is not None:
        verdict.notes.append(f"{large['name']}'s ops cost {ms(large['overhead_s'])} of host time; at the rate it read "
                             f"its weights ({si(large['weight_bytes'] / (large['step_s']['eager'] - large['overhead_s']), 'B/s')}) "
                             f"that is the time to read {si(even, 'B')}: a model of its depth with fewer weight "
                             f"bytes waits more on its host than on memory")
    verdict.notes[-1] += (f"; at the one-row product's rate ({si(bandwidth, 'B/s')}) its host time equals the floor of a "
                          f"model of {si(large['overhead_s'] * bandwidth, 'B')}")
    if on_cuda:
        verdict.notes.append(", ".join(f"{p['name']}: graph {ms(p['step_s']['graph'])} against eager "
                                       f"{ms(p['step_s']['eager'])}, {p['floor_s'] / p['step_s']['graph']:.0%} of the "
                                       "floor" for p in points))
    print_verdict(verdict)
    return verdict, even


def plot(lesson, s: dict, points: list[dict], predicted: dict, even, verdict) -> None:
    large, bandwidth = points[-1], read_rate(lesson)
    modes = [m for m in points[0]["step_s"] if m != "twin graph"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 5.4))
    wb = [p["weight_bytes"] for p in points]
    styles = {"eager": "o-", "static": "s--", "graph": "^-", "twin": "x:"}
    for m in modes:
        axes[0].loglog(wb, [p["step_s"][m] * 1e3 for p in points], styles[m],
                       label="twin: the same ops at width 8 (host cost)" if m == "twin" else f"{m} step")
    hi = 2 * max(wb + [even or 0])
    grid = [min(wb) / 2 * (hi / (min(wb) / 2)) ** (i / 50) for i in range(51)]
    axes[0].loglog(grid, [b / bandwidth * 1e3 for b in grid], "k-", lw=1, label="weights at the one-row product's rate")
    for p in points:  # names above the highest marker of each shape, clear of every marker
        axes[0].annotate(p["name"], (p["weight_bytes"], max(p["step_s"].values()) * 1e3), textcoords="offset points",
                         xytext=(0, 8), ha="center", va="bottom", fontsize=8, bbox={"fc": "white", "ec": "none"})
    if even is not None:
        axes[0].axvline(even, color="grey", ls=":", label=f"weights read as long as {large['name']}'s ops take")
    axes[0].set(xlabel="weight bytes", ylabel="step time (ms)",
                ylim=(None, 6e3 * max(p["step_s"][m] for p in points for m in modes)),
                title="step time against weight bytes (medians of each shape's rounds)")
    axes[0].legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    xs = range(len(points))
    axes[1].bar(xs, [p["share_median"] for p in points], color="C0", label="overhead share (median)",
                yerr=[[p["share_median"] - min(p["share"]) for p in points],
                      [max(p["share"]) - p["share_median"] for p in points]], capsize=3)
    axes[1].plot(xs, [predicted["share"][p["name"]] for p in points], "x", color="navy", ms=9,
                 label="predicted before measuring (ops · c ÷ t)")
    axes[1].axhline(OVERHEAD_BOUND, color="k", ls="--", lw=1, label="overhead-bound above, memory-bound below")
    axes[1].set(xticks=list(xs), xticklabels=[p["name"] for p in points], ylabel="twin time ÷ eager step",
                title="share of the step that is host overhead (bars: range)",
                ylim=(0, 1.4 * max(1.0, *(max(p["share"]) for p in points), *predicted["share"].values())))
    axes[1].legend(fontsize=8, loc="upper right")
    op_modes, width = [m for m in modes if m != "twin"], 0.8 / (len(modes) - 1)
    for j, m in enumerate(op_modes):
        axes[2].bar([x + (j - (len(op_modes) - 1) / 2) * width for x in xs], [p["ops"][m] for p in points], width,
                    label=f"{m}" + (" (host ops around one replay)" if m == "graph" else ""))
    axes[2].set(xticks=list(xs), xticklabels=[p["name"] for p in points], ylabel="ATen ops dispatched per step",
                title="ops per decode step")
    axes[2].legend(fontsize=8, loc="upper left")
    save_plot(lesson, fig, verdict)


def main(argv=None) -> dict:
    args = make_parser(__doc__).parse_args(argv)
    lesson = start(NAME, args, on_one_thread=True)  # the roof of a step on one thread: the kernels on one thread
    s, names = SIZES[args.quick], ladder(args.model, lesson.config.num_params())
    with contextlib.nullcontext() if lesson.device.type == "cuda" else one_thread():
        x = torch.zeros(1, device=lesson.device)
        bare = time_fn(lambda: [x.add_(1) for _ in range(1000)], lesson.device, 1, 5).median_s / 1000  # one bare op
        predicted = predict_ladder(lesson, names, s, bare)
        points = []
        for name in names:
            model = lesson.model if name == args.model else random_model(PRESETS[name], lesson.device, lesson.dtype)
            side = {names[0]: ">=", names[-1]: "<=" if predicted["share"][names[-1]] < OVERHEAD_BOUND else None}.get(name)
            points.append(measure(model, name, s, read_rate(lesson), side))
            del model
    print_ladder(lesson, s, points)
    figures = {"context_len": s["context"], "rounds": s["rounds"], "bare_op_s": bare, "points": points,
               "on_cuda": lesson.device.type == "cuda", "predicted": predicted, "crossover": crossover(points)}
    verdict, even = judge_claim(lesson, figures, bare)
    plot(lesson, s, points, predicted, even, verdict)
    figures.update(even_bytes=even, host_time_equals_floor_of_bytes=points[-1]["overhead_s"] * read_rate(lesson))
    write_results(lesson, figures, verdict)
    return {"figures": figures, "verdict": verdict}


if __name__ == "__main__":
    run(main)
