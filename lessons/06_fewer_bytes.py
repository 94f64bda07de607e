"""Lesson 06: fewer bytes per token. A memory-bound step is as fast as the bytes it reads.

The claim
---------
Lesson 04 showed that a decode step reads every weight once to do about 2 FLOPs per weight: its time is
bytes ÷ bandwidth. The lever that follows is fewer bytes per weight (`minillm/quantize.py`): fp32 4 bytes, bf16
2, int8 weight-only 1 plus an fp32 scale per row (W8A16, as vLLM and gpt-fast run it: activations in bf16). So:

- batch-1 decode gets faster with the bytes it reads, fp32 → bf16 → int8, close to the byte ratio, while it is
  memory-bound: a step takes its bytes ÷ the stream of the kernel that reads them, so by the byte ratio where
  the kernels stream alike; where this machine's kernel for the smaller dtype streams too slowly to show it, that
  kernel, not the memory, sets the pace, and the run names it and leaves the byte ratio undecided;
- prefill does not: its matmuls reuse each weight for every token, so it is compute-bound, and int8 saves bytes
  it was not waiting for. On most CPUs nothing multiplies int8 weights by floating activations: the weights are
  widened to bf16 (a transient copy) and multiplied there, so prefill runs at bf16's arithmetic rate, plus the
  widening (emulated and slower than fp32 where the CPU lacks AVX512_BF16 or AMX);
- the advantage shrinks as the batch grows: bf16 and int8 do the same bf16 arithmetic, so once the step
  crosses the ridge their times meet, and past `FUSED_MAX_ROWS` rows int8 pays the widening too;
- it costs accuracy: every weight rounded to one of 255 levels of its row (int8) or to 8 bits of mantissa (bf16).

What this lesson measures
-------------------------
Decode steps at a fixed context for a sweep of batches, and a prefill, for the three variants, in turns; each
beside the cost model's prediction, made before it measures: max(FLOPs ÷ peak, bytes ÷ stream), bytes as each
model stores them (`cost.weight_bytes_read`), the peak of the dtype its product computes in, and the stream the
bytes/s at which that variant's own one-row kernel read a stack of its projections (`roofline.py`'s one-row
product; int8's through its own module), at most the bandwidth. It leaves out the host work and small kernels
a step also pays (about the same time in each variant: it pulls a ratio of two steps toward 1), and it times
the kernels alone, so a batch-1 ratio is judged on measured ÷ predicted within CLOSE to 1 ÷ CLOSE (the mechanism),
and against CLOSE × the byte ratio (the claim) wherever the kernels' own prediction reaches that line.
Prefill and the shrinking advantage are judged against the geometric middle between the two stories (bytes,
or arithmetic): the run says which one its numbers follow. The cost, on a seeded model whose next token
depends on its context (std 0.3; on GPT-2's own 0.02 init every variant would "agree"): max |logit diff|,
KL(fp32 ‖ x), greedy agreement along a long fp32 generation, each beside the additive-noise model's prediction
(`minillm/bench/accuracy.py`); perplexity on real text where real weights are present.

Predict before you run: how much faster is an int8 decode step than fp32's on this machine, and a prefill?
"""
from __future__ import annotations

import dataclasses
import math
import statistics

from common import (REPO_ROOT, make_parser, ms, plot_checks, plt, predict, print_table, quiet_load_model, run,
                    save_plot, si, start, ticks_at, write_results)
import torch  # after common, which imports minillm: OpenMP's wait policy is set before torch loads it
from minillm.bench.verdict import Check, Fact, interleave, judge, print_verdict, settled

from minillm.bench.accuracy import accuracy_setup, perplexity as text_perplexity, variant_accuracy
from minillm.bench.cost import as_stored, decode_cost, prefill_cost, weight_bytes_read
from minillm.bench.roofline import measure_ceilings
from minillm.bench.steps import decode_step, prefill_step
from minillm.checkpoints.tokenizer import load_tokenizer
from minillm.cpu_layout import cpuinfo, native_bf16
from minillm.quantize import FUSED_MAX_ROWS, WeightOnlyInt8Linear, WeightOnlyInt8LMHead

NAME = "06_fewer_bytes"
VARIANTS = {"fp32": (torch.float32, None), "bf16": (torch.bfloat16, None), "int8": (torch.bfloat16, "int8")}
CLOSE = 0.7                # batch-1 decode: measured ratio ÷ the kernels' predicted, within CLOSE to 1 ÷ CLOSE
CONTEXT_STD = 0.3          # the accuracy model's init: its next token depends on its context
MAX_ABS_DIFF = {"bf16": 1.0, "int8": 2.0}    # on that model's logits of about ±11
MEAN_KL = {"bf16": 0.003, "int8": 0.008}     # nats, per position (rounding toward zero gives int8 about 0.009)
GREEDY_AGREEMENT = 0.9     # the variant's greedy choice equals fp32's at this share of fp32's generation
SENSITIVE = 0.5            # the accuracy model changes its next token for this share of prompts whose first changes


def sizes(n_ctx: int, quick: bool) -> dict:
    return {"context": min(128, n_ctx // 2), "prompt": min(64 if quick else 256, n_ctx // 2), "repeats": 5,
            "batches": [1, 4, 16, 32] if quick else [1, 2, 4, 8, 16, 32, 64, 128], "prompts": 8 if quick else 16}


def predicted_s(cost, model, peak: float, stream: float, bandwidth: float) -> float:
    """The step's time: max(FLOPs ÷ peak, bytes ÷ stream), `stream` the bytes/s at which the variant's own one-row
    kernel reads its weights (bandwidth for the ideal); where an int8 model widens its weights to bf16 before the
    product (on a CPU above FUSED_MAX_ROWS rows, elsewhere always), that copy comes first, at the bandwidth:
    2 bytes written and 2 read back a weight."""
    wide = lambda rows: model.device.type != "cpu" or rows > FUSED_MAX_ROWS  # noqa: E731
    widened = sum(4 * m.weight.numel() for m in model.modules() if isinstance(m, WeightOnlyInt8Linear) and
                  wide(cost.tokens) or isinstance(m, WeightOnlyInt8LMHead) and wide(cost.lm_head_rows))
    return max(cost.flops / peak, cost.bytes / stream) + widened / bandwidth


def plan(lesson, models: dict, ceil: dict, s: dict) -> dict:
    """Every step's cost and predicted time, before anything is timed (the figures, without their times)."""
    cfg, bw = lesson.config, max(c.bandwidth for c in ceil.values())  # one bandwidth: the device's best read
    peak = {v: ceil[v].matmul_flops for v in VARIANTS}
    stream = {v: min(bw, ceil[v].kernels[("int8 " if q else "") + "one-row product"]["rate"])  # bytes/s
              for v, (_, q) in VARIANTS.items()}  # each variant's own one-row kernel, as `roofline.py` timed it
    f = {"decode": {v: [] for v in VARIANTS}, "prefill": {}, "bandwidth": bw, "peak": peak, "one_row_stream": stream}
    for v, model in models.items():
        costs = {b: decode_cost(cfg, s["context"], b, VARIANTS[v][0]) for b in s["batches"]}
        for b, cost in {**costs, "prefill": prefill_cost(cfg, s["prompt"], 1, VARIANTS[v][0])}.items():
            cost = as_stored(cost, model)
            e = {"bytes": cost.bytes, "flops": cost.flops, "ideal_s": predicted_s(cost, model, peak[v], bw, bw),
                 "predicted_s": predicted_s(cost, model, peak[v], stream[v], bw)}
            f["decode"][v].append({"batch": b, **e}) if b != "prefill" else f["prefill"].update({v: e})
    p1 = {v: f["decode"][v][0]["predicted_s"] for v in VARIANTS}
    pre = {v: e["predicted_s"] for v, e in f["prefill"].items()}
    i1 = {v: f["decode"][v][0]["ideal_s"] for v in VARIANTS}
    lines = [f"batch-1 decode at context {s['context']}: fp32 {ms(p1['fp32'])}, bf16 {ms(p1['bf16'])}, int8 "
             f"{ms(p1['int8'])} (bytes ÷ the one-row kernel's stream: " + ", ".join(
                 f"{v} {si(stream[v], 'B/s')}" for v in VARIANTS) + f"): each step of the chain about "
             f"{p1['fp32'] / p1['bf16']:.2f}× and {p1['bf16'] / p1['int8']:.2f}× faster; at the bandwidth "
             f"({si(bw, 'B/s')}), the bytes alone, {i1['fp32'] / i1['bf16']:.2f}× and {i1['bf16'] / i1['int8']:.2f}×",
             f"prefill of {s['prompt']} tokens: bf16 ÷ int8 {pre['bf16'] / pre['int8']:.2f}×, fp32 ÷ int8 "
             f"{pre['fp32'] / pre['int8']:.2f}× (peaks {si(peak['fp32'], 'FLOP/s')} in fp32, "
             f"{si(peak['int8'], 'FLOP/s')} in bf16, where int8's product computes)"]
    return {"figures": f, "lines": lines}


def expected(f: dict) -> dict[str, float]:
    """Each check's prediction, from the figures before anything is measured (their values stand in)."""
    timed = {"decode": {v: [{**e, "times_s": [1.0]} for e in es] for v, es in f["decode"].items()},
             "prefill": {v: {**e, "times_s": [1.0]} for v, e in f["prefill"].items()}}
    acc = {**f["accuracy"], **{v: {**e, "first_divergence_median": 0} for v, e in f["accuracy"]["predicted"].items()}}
    return {c.key: c.predicted for c in checks({**f, **timed, "accuracy": acc})}


def ridge_batch(cfg, context: int, ridge: float) -> int:
    """The first batch at which a bf16 decode step's intensity reaches the ridge (the roofline's compute-bound)."""
    return next((b for b in range(1, 4096) if decode_cost(cfg, context, b, torch.bfloat16).intensity >= ridge), 4096)


def perplexity(lesson, models: dict) -> dict | None:
    """Each variant's perplexity on real prose (docs/design.md), with the real weights; None without them."""
    tokenizer = None if lesson.model.weights_source.startswith("random-init") else load_tokenizer(lesson.args.model)
    if tokenizer is None or tokenizer.is_fallback:
        return None
    ids = torch.tensor(tokenizer.encode((REPO_ROOT / "docs" / "design.md").read_text())[:lesson.config.n_ctx])
    with torch.inference_mode():
        return {"tokens": len(ids), "text": "docs/design.md",
                **{v: text_perplexity(m(ids[None].to(lesson.device))[0].cpu(), ids) for v, m in models.items()}}


def measure(lesson, models: dict, f: dict, s: dict) -> dict:
    """Every variant's decode steps and prefill, in turns; the figures every check is built from."""
    fns = {**{f"{v} batch {b}": decode_step(m, s["context"], b) for v, m in models.items() for b in s["batches"]},
           **{f"{v} prefill": prefill_step(m, s["prompt"]) for v, m in models.items()}}

    def figures_of(rounds) -> dict:
        return {**f, "decode": {v: [{**e, "times_s": rounds.times(f"{v} batch {e['batch']}")} for e in es]
                                for v, es in f["decode"].items()},
                "prefill": {v: {**e, "times_s": rounds.times(f"{v} prefill")} for v, e in f["prefill"].items()}}
    rounds = interleave(fns, s["repeats"], device=lesson.device, desc="variants and batches, in turns",
                        until=settled(lambda r: checks(figures_of(r))))
    figures = figures_of(rounds)
    rows = [[label] + [ms(statistics.median(e[v]["times_s"])) for v in VARIANTS] + [ms(e[v]["predicted_s"]) for v in
            VARIANTS] + [f"{statistics.median(per_round(e[v], e['int8'])):.2f}" for v in ("fp32", "bf16")]
            for label, e in [(b, {v: figures["decode"][v][i] for v in VARIANTS}) for i, b in enumerate(s["batches"])]
            + [("prefill", figures["prefill"])]]
    print_table(["batch", "fp32", "bf16", "int8", "fp32 pred.", "bf16 pred.", "int8 pred.", "fp32÷int8", "bf16÷int8"],
                rows, f"Decode steps at context {s['context']} and a {s['prompt']}-token prefill, {lesson.args.model} "
                      f"(medians of {rounds.count} rounds; pred.: at each kernel's stream, before measuring):")
    return {"figures": figures, "rounds": rounds}


def per_round(slow: dict, fast: dict) -> list[float]:  # how many times faster `fast` is, round by round
    return [a / b for a, b in zip(slow["times_s"], fast["times_s"])]


def vanishing_batch(d: dict, measured: bool) -> int:
    """The first batch of the sweep at which int8's step is no faster than bf16's (0: none in the sweep)."""
    return next((i8["batch"] for b16, i8 in zip(d["bf16"], d["int8"]) if (statistics.median(per_round(b16, i8))
                 if measured else b16["predicted_s"] / i8["predicted_s"]) <= 1), 0)


def checks(figures: dict) -> list[Check]:
    """The claim's checks, from the figures the lesson writes to its JSON."""
    d, pre, out = figures["decode"], figures["prefill"], []
    for slow, fast in (("fp32", "bf16"), ("bf16", "int8")):
        pred = d[slow][0]["predicted_s"] / d[fast][0]["predicted_s"]
        ratio, name = per_round(d[slow][0], d[fast][0]), f"batch-1 decode, {slow} step ÷ {fast} step"
        out.append(Check(f"{name}, at most", ratio, pred / CLOSE, "<=", fmt="{:.2f}", predicted=pred,
                         key=f"decode_{slow}_over_{fast}_at_most", why=f"{fast}'s step ran faster than its one-row "
                         f"kernel streams its bytes ({figures['one_row_stream'][fast] / 1e9:.3g} GB/s), or {slow}'s "
                         "slower than its own: a kernel in the step the ceilings did not time"))
        out.append(Check(name, ratio, CLOSE * pred, ">=", fmt="{:.2f}", predicted=pred, key=f"decode_{slow}_over_{fast}",
                         why=f"the bytes fall {d[slow][0]['bytes'] / d[fast][0]['bytes']:.2f}×, its kernels "
                             f"predict {pred:.2f}×, the step less "
                             f"({fast} at {statistics.median(d[fast][0]['times_s']) * 1e3:.3g} ms against "
                             f"{d[fast][0]['predicted_s'] * 1e3:.3g} ms at its one-row product's "
                             f"{figures['one_row_stream'][fast] / 1e9:.3g} GB/s of the {figures['bandwidth'] / 1e9:.3g}"
                             f" GB/s measured): the rest of {fast}'s step (host work, the small kernels around its "
                             "products) costs more than its kernel's bytes save"))
        ideal, rate, bw = d[slow][0]["bytes"] / d[fast][0]["bytes"], figures["one_row_stream"], figures["bandwidth"]
        out.append(Check(f"{name}, against the byte ratio", ratio, CLOSE * ideal, ">=", fmt="{:.2f}", predicted=pred,
                         key=f"decode_{slow}_over_{fast}_by_bytes", undecided="" if pred >= CLOSE * ideal else
                         f"this machine's one-row {fast} kernel streams {rate[fast] / 1e9:.3g} GB/s ({slow}'s "
                         f"{rate[slow] / 1e9:.3g}) of the {bw / 1e9:.3g} GB/s a copy reads, so the kernels predict "
                         f"{pred:.2f}×, under {CLOSE} × the byte ratio {ideal:.2f}×: a kernel we have, not the "
                         "hardware, cannot show the byte ratio here",
                         why=f"the bytes fall {ideal:.2f}× and the kernels predict {pred:.2f}×, but {fast}'s step "
                             f"ran only {statistics.median(ratio):.2f}× as fast as {slow}'s"))
    bytes_ratio = pre["bf16"]["bytes"] / pre["int8"]["bytes"]
    pred = pre["bf16"]["predicted_s"] / pre["int8"]["predicted_s"]
    out.append(Check("prefill, bf16 step ÷ int8 step (the same arithmetic)", per_round(pre["bf16"], pre["int8"]),
                     math.sqrt(bytes_ratio * pred), "<=", fmt="{:.2f}", predicted=pred, key="prefill_bf16_over_int8",
                     undecided="" if pred * 1.2 < bytes_ratio else
                     f"the cost model predicts this prefill {pred:.2f}× faster in int8, about as much as the bytes "
                     f"fall ({bytes_ratio:.2f}×): it is not compute-bound, so this run cannot tell the two apart",
                     why=f"prefill sped up by about the byte ratio ({bytes_ratio:.2f}×), not the {pred:.2f}× the "
                         "arithmetic predicts: it was not compute-bound at this prompt length"))
    last = len(d["int8"]) - 1
    one, big = per_round(d["bf16"][0], d["int8"][0]), per_round(d["bf16"][last], d["int8"][last])
    pred = (d["bf16"][last]["predicted_s"] / d["int8"][last]["predicted_s"]) / (
        d["bf16"][0]["predicted_s"] / d["int8"][0]["predicted_s"])
    out.append(Check(f"bf16 ÷ int8 step at batch {d['int8'][last]['batch']}, over the same at batch 1",
                     [b / a for a, b in zip(one, big)], math.sqrt(pred), "<=", fmt="{:.2f}", predicted=pred,
                     key="advantage_shrinks", undecided="" if pred < 0.8 else
                     f"the cost model predicts the sweep's largest batch to keep {pred:.2f} of int8's batch-1 "
                     "advantage; sweep larger batches",
                     why=f"int8's advantage over bf16 held at batch {d['int8'][last]['batch']}: its step there was "
                         f"{statistics.median(big):.2f}× faster against {statistics.median(one):.2f}× at batch 1"))
    acc = figures["accuracy"]
    out.append(Check("share of prompts whose greedy token changes with their first token", [acc["context_sensitivity"]],
                     SENSITIVE, ">=", timed=False, fmt="{:.2f}", key="context_sensitivity",
                     predicted=1 - 1 / acc["vocab"], why="the accuracy model ignores its context: any two variants "
                     f"would agree on it (1 − 1/{acc['vocab']}: a model that reads it, barring a chance repeat)"))
    for v in ("bf16", "int8"):
        a, pred = acc[v], acc["predicted"][v]
        out += [Check(f"{v}: max |logit − fp32's|", [a["max_abs_diff"]], MAX_ABS_DIFF[v], "<=", timed=False,
                      key=f"{v}_max_abs_diff", predicted=pred["max_abs_diff"],
                      why=f"KL {a['mean_kl']:.3g} nats on average, {a['max_kl']:.3g} at most"),
                Check(f"{v}: mean KL(fp32 ‖ {v}), nats", [a["mean_kl"]], MEAN_KL[v], "<=", timed=False,
                      key=f"{v}_mean_kl", predicted=pred["mean_kl"], why=f"its largest logit error is "
                      f"{a['max_abs_diff']:.3g}, the noise model's {pred['max_abs_diff']:.3g}"),
                Check(f"{v}: greedy agreement with fp32's generation", [a["greedy_agreement"]], GREEDY_AGREEMENT,
                      ">=", timed=False, fmt="{:.3f}", key=f"{v}_greedy_agreement", predicted=pred["greedy_agreement"],
                      why=f"free-running, {v} leaves fp32's tokens after {a['first_divergence_median']:g} (median)")]
    return out


def facts(f: dict) -> list[Fact]:
    d = f["decode"]
    measured, predicted, last = vanishing_batch(d, True), vanishing_batch(d, False), d["int8"][-1]["batch"]
    return [Fact("int8 weight bytes ÷ fp32's", f["weight_bytes"]["int8"] / f["weight_bytes"]["fp32"], fmt="{:.3f}",
                 why="counted from the models as stored (int8, its fp32 scales, the rest in bf16)"),
            Fact(f"first batch where int8's step is no faster than bf16's (0: none up to batch {last})", measured,
                 predicted=(predicted or None) if measured else None, fmt="{:g}", why=f"judged by the shrinking "
                 f"advantage; the cost model: {predicted or 'none'}, and bf16's step at the ridge from batch "
                 f"{f['ridge_batch']:g}")] + [
            Fact(f"batch-1 decode, {a} step ÷ {b} step at the bandwidth (the ideal: the byte ratio)", d[a][0]["bytes"]
                 / d[b][0]["bytes"], fmt="{:.2f}", why="what kernels streaming at the bandwidth would give; the checks "
                 "judge the kernels these steps run") for a, b in (("fp32", "bf16"), ("bf16", "int8"))] + [
            Fact(f"{v}: its one-row kernel's stream ÷ the bandwidth", f["one_row_stream"][v] / f["bandwidth"],
                 fmt="{:.2f}", why=f"{f['one_row_stream'][v] / 1e9:.3g} of {f['bandwidth'] / 1e9:.3g} GB/s (a copy's "
                 f"read stream): what a better {v} kernel could buy at batch 1") for v in VARIANTS] + [
            Fact(f"{v}: perplexity ÷ fp32's on real text", ppl[v] / ppl["fp32"], fmt="{:.4f}", why=f"fp32 "
                 f"{ppl['fp32']:.4g} over {ppl['tokens']} tokens of {ppl['text']}; the logits above judge the cost")
            for v in ("bf16", "int8") if (ppl := f.get("perplexity"))]


def plot(lesson, f: dict, verdict) -> None:
    axes = (fig := plt.figure(figsize=(15, 10))).subplots(2, 2).flatten()
    batches, d = [e["batch"] for e in f["decode"]["fp32"]], f["decode"]
    for v, color in zip(VARIANTS, ("C0", "C1", "C2")):
        axes[0].plot(batches, [statistics.median(e["times_s"]) * 1e3 for e in d[v]], "o-", color=color, label=v)
        axes[0].plot(batches, [e["predicted_s"] * 1e3 for e in d[v]], "--", color=color, label=f"{v}, predicted")
        if v != "int8":
            axes[1].plot(batches, [statistics.median(per_round(e, i8)) for e, i8 in zip(d[v], d["int8"])], "o-",
                         color=color, label=f"{v} ÷ int8, measured")
            axes[1].plot(batches, [e["predicted_s"] / i8["predicted_s"] for e, i8 in zip(d[v], d["int8"])], "--",
                         color=color, label=f"{v} ÷ int8, predicted (the kernels' streams)")
    axes[1].axhline(1, color="k", lw=1)
    axes[1].axvline(f["ridge_batch"], color="grey", ls=":", label="bf16 decode reaches the ridge (roofline)")
    axes[0].set(ylabel="decode step (ms, log)", yscale="log",
                title="decode step, medians (dashed: predicted, bytes at each kernel's stream or FLOPs at the peak)")
    axes[1].set(ylabel="step time ÷ int8's step", title="int8's advantage as the batch grows (medians)")
    for ax in axes[:2]:
        ax.set(xscale="log", xlabel="batch")
        ticks_at(ax, batches)
        ax.legend(fontsize=7)
    plot_checks(axes[2], dataclasses.replace(verdict, checks=[c for c in verdict.checks if c.timed]))
    counted = [c for c in verdict.checks if not c.timed]
    axes[3].barh(range(len(counted)), [c.median / c.line for c in counted],
                 color=["darkgreen" if c.outcome() == "HOLDS" else "firebrick" for c in counted])
    axes[3].axvline(1, color="k", ls="--", lw=1)
    axes[3].set_yticks(range(len(counted)), [c.key for c in counted], fontsize=8)
    axes[3].set(xscale="log", xlabel="value ÷ its line (≤ checks hold left of 1, ≥ checks right of it)",
                title="the counted checks: the cost, on a model that reads its context")
    save_plot(lesson, fig, verdict)


def main(argv=None) -> dict:
    args = make_parser(__doc__).parse_args(argv)
    lesson = start(NAME, args, ceilings=False)
    s = sizes(lesson.config.n_ctx, args.quick)
    models = {v: lesson.model if (lesson.dtype, args.quantization) == (dt, q) else
              quiet_load_model(args.model, lesson.device, dt, q) for v, (dt, q) in VARIANTS.items()}
    ceil = {v: measure_ceilings(lesson.device, dt, quick=args.quick, quantization=q) for v, (dt, q) in VARIANTS.items()}
    lesson.ceilings = ceil["fp32"]
    p, a = plan(lesson, models, ceil, s), accuracy_setup(s["prompts"], CONTEXT_STD)
    f = {"context_len": s["context"], "prompt_len": s["prompt"], **p["figures"], "accuracy": a["figures"],
         "weight_bytes": {v: weight_bytes_read(m) for v, m in models.items()},
         "native_bf16": native_bf16(cpuinfo("flags")) if lesson.device.type == "cpu" else None}
    f["ridge_batch"] = ridge_batch(lesson.config, s["context"], f["peak"]["bf16"] / f["bandwidth"])
    predict(lesson, *p["lines"], expect=expected(f))
    f.update(accuracy=variant_accuracy(a), perplexity=perplexity(lesson, models))
    m = measure(lesson, models, f, s)
    f, pre = m["figures"], m["figures"]["prefill"]
    verdict = judge("a batch-1 decode step takes its bytes at its kernel's stream, and fewer bytes per weight make it "
                    "faster, close to the byte ratio (judged where this machine's kernels predict it); not prefill, "
                    "and less so as the batch grows; at a bounded cost in the logits", checks(f), lesson.load(),
                    [m["rounds"]], facts=facts(f))
    verdict.notes += [f"int8's prefill ran {statistics.median(per_round(pre['fp32'], pre['int8'])):.2f}× as fast as "
                      f"fp32's: its weights are widened to bf16 and multiplied there, at bf16's peak, "
                      f"{f['peak']['int8'] / f['peak']['fp32']:.2f}× fp32's" + ("" if f["native_bf16"] is None else
                      f" (this CPU {'has' if f['native_bf16'] else 'lacks, and emulates'} bf16 dot products: "
                      "AVX512_BF16 or AMX in /proc/cpuinfo)")]
    if f["perplexity"] is None:
        verdict.notes.append(f"perplexity on real text: not measured; {args.model}'s real weights are not here")
    print_verdict(verdict)
    plot(lesson, f, verdict)
    write_results(lesson, f, verdict)
    return {"figures": f, "verdict": verdict}


if __name__ == "__main__":
    run(main)
