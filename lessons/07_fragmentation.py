"""Lesson 07: fragmentation. Reserving for the worst case wastes most of the KV memory; paging does not.

The claim
---------
A server cannot know where a request's output will stop, so a naive one
reserves, for every sequence it admits, one contiguous slab of KV memory for
the longest sequence it serves (max_model_len, M; here the model's context).
Whatever the sequence does not fill is *internal fragmentation*:

    contiguous waste = 1 − Σ len_i / (running · M)

vLLM's paper measured that earlier systems kept real tokens in only 20–38% of
their KV memory: 60–80% waste. PagedAttention (`minillm/block_manager.py`,
`minillm/paged_attention.py`) hands out blocks of `block_size` slots as a
sequence grows, so only each sequence's last block is partly empty:

    paged waste ≈ running · block_size/2 / (Σ len_i + running · block_size/2)   → under 4% in vLLM

Less waste means more sequences in the same bytes, i.e. a bigger decode batch,
which lesson 04 showed is cheap while decode is memory-bound. (What paging
costs the attention kernel is lesson 08.)

What this lesson measures
-------------------------
A trace of 20 requests, all queued at t = 0 (an offline batch: the queue never
empties, so memory, not arrivals, limits concurrency), with seeded log-normal
lengths shaped after ShareGPT (vLLM's paper: mean prompt 161, mean output 338
tokens), outputs shortened so a CPU run takes a minute (shorter sequences make
paging's waste *larger*, so this is the harder case):
    prompt ~ LogNormal(ln(M · 5/32), 0.7) in [1, M/2],  output ~ LogNormal(ln(M/16), 0.7) in [1, M − prompt]
It is served under one KV budget, room for 4 full reservations (4·M tokens):
- contiguous: the engine may run only 4 sequences at once (4 slabs of M fill
  the budget) and is charged a full slab per running sequence;
- paged: blocks of 16 from the same budget, as many sequences as fit.
Both use the same `LLMEngine`, scheduler and attention kernel, so the
difference is the memory policy alone (`minillm/bench/kv_waste.py`). After
every step we record the real tokens held (Σ cached tokens of the running
sequences) against the memory allocated (contiguous: running · M; paged:
blocks in use · 16), and the running and waiting sequences. Then the same
trace is served again per block size.

Waste is a property of token counts: the scheduler and the block manager never
look at the model's width. So the trace is replayed through a 1-layer, 8-wide
model of the same context and vocabulary, in seconds; `--quick` judges the
claim from that replay and only the full run serves the trace with the real
model too (its waste must equal the narrow replay's, and its tokens/s shows
what the extra concurrency buys on this device).

Sharing (`minillm/parallel_sampling.py`). Blocks counted by reference can be
shared: n samples of one prompt hold its ⌊P/bs⌋ full blocks once and copy the
partly filled last one only when each writes (copy-on-write). The first 8
prompts of the trace are served with n = 4 samples each (`--quick`: outputs cut
to 16 tokens), as one request of n samples and as n requests of one, in a pool
that holds them all; block arithmetic predicts each request's most blocks and
the copies exactly (greedy: blocks count tokens, whichever they are). Then
they are served in the lesson's budget, both ways: fewer blocks per sample,
more samples running, fewer steps for the same tokens (lesson 04: tokens per
step is what a memory-bound decode turns into tokens/s).

The prediction, from the trace's lengths before anything is served: over a
sequence's life its length averages L̄ = Σ (p·o + o²/2) / Σ o, and its last
block holds (bs − 1)/2 empty slots on average, so paged waste ≈ (bs − 1)/2 ÷
(L̄ + (bs − 1)/2), a slab wastes 1 − L̄/M, and the budget holds B ÷ (L̄ +
(bs − 1)/2) paged sequences against its 4 slabs.

The verdict (counts, so never inconclusive), on the mechanism: paged waste
≤ 2 × the formula's (the band: the formula averages the last block's fill and
the lengths over few sequences at a time); paged
sustains at least 2× the contiguous concurrent sequences (mean running while
requests still wait); and n samples sharing a prompt hold no more blocks than
block arithmetic gives for sharing its full blocks. vLLM's figures (under 4%
waste, 60–80% for slabs, 6.1–9.8% saved by sharing) are printed beside them
as context: how far this trace lands from them is the workload's doing.

Predict before you run: with prompts around 170 tokens and outputs around 70,
what share of a 1,024-token slab holds real tokens on average? With blocks of
16, how many slots per sequence are wasted, and what share is that?
"""
from __future__ import annotations

from dataclasses import replace

from matplotlib.ticker import MaxNLocator

from common import make_parser, one_thread, plt, predict, print_table, run, save_plot, si, start, write_results
from minillm.bench.kv_waste import narrow_model, paged_engine, serve_in_budget
from minillm.bench.replay import replay_samples
from minillm.bench.verdict import Check, Fact, judge, print_verdict
from minillm.bench.workloads import describe_trace, lognormal_trace
from minillm.parallel_sampling import group_blocks

NAME = "07_fragmentation"
VLLM_CONTIGUOUS_WASTE = (0.60, 0.80)  # vLLM paper: earlier systems used 20–38% of KV memory for tokens
PAGED_WASTE_LIMIT = 0.04              # ... and PagedAttention wastes under 4%
CONCURRENCY_FACTOR = 2.0              # paged must sustain ≥ 2× the contiguous concurrent sequences
REQUESTS, RESERVATIONS, BLOCK_SIZE = 20, 4, 16
POLICIES = {"contiguous": RESERVATIONS, "paged": None}  # policy: its contiguous slabs (None: paged blocks)
SAMPLES, SHARED_PROMPTS = 4, 8        # n samples of each of the trace's first 8 prompts
PAPER_SHARING_SAVING = 0.061          # vLLM paper: parallel sampling saves 6.1–9.8% of KV memory
WASTE_BAND = 2.0                      # paged waste ≤ this × the formula's (averages over few sequences)


def sharing(lesson, trace: list, budget_tokens: int, cap: int | None, real_model: bool) -> dict:
    """Predict from block arithmetic, then count: the shared prompts in a pool that holds them all, both ways;
    then in the lesson's budget (with `real_model`, through its model too, timed). `cap`: a sample's most tokens."""
    n, bs = SAMPLES, BLOCK_SIZE
    shared = [replace(r, max_tokens=min(r.max_tokens, cap or r.max_tokens)) for r in trace[:SHARED_PROMPTS]]
    alone = []
    for r in shared:
        P, T = len(r.prompt), r.max_tokens
        alone.append({"prompt_tokens": P, "output_tokens": T,  # a sample of one token never forks its blocks
                      "predicted_grouped": group_blocks(P, P + T - 1, n if T > 1 else 1, bs),
                      "predicted_separate": n * -(-(P + T - 1) // bs),
                      "predicted_copies": n - 1 if P % bs and T > 1 else 0})
    g, sep = (sum(a[k] for a in alone) for k in ("predicted_grouped", "predicted_separate"))
    predict(lesson, f"{n} samples of each of {len(shared)} prompts ({sum(a['prompt_tokens'] for a in alone)} prompt "
            f"tokens, {sum(a['output_tokens'] for a in alone)} output tokens a sample, in all): sharing each prompt's ⌊P/{bs}⌋ "
            f"full blocks, {g} blocks at their peaks instead of {sep}, {1 - g / sep:.0%} fewer, and "
            f"{sum(a['predicted_copies'] for a in alone)} copy-on-write copies ({n - 1} per prompt that ends inside "
            "a block)", "so in one budget, more samples run at once and the same tokens take fewer steps")
    narrow, ways = narrow_model(lesson.model), ("grouped", "separate")

    def both(model, blocks: int) -> dict:
        return {way: replay_samples(paged_engine(model, blocks, bs), shared, n, way == "grouped") for way in ways}
    with one_thread():
        ample, together = both(narrow, sep), both(narrow, budget_tokens // bs)
    real = both(lesson.model, budget_tokens // bs) if real_model else {}
    for i, a in enumerate(alone):
        a.update({way: ample[way]["request_peaks"][i] for way in ways})
    measured = {**{way: sum(a[way] for a in alone) for way in ways}, "copies": ample["grouped"]["copies"]}
    print_table(["served as", "blocks at the peaks", "copies", "steps in the budget", "tokens / step",
                 "prefill tokens", "preemptions"],
                [[way, measured[way], ample[way]["copies"], t["steps"], f"{t['tokens_per_step']:.1f}",
                  t["prefill_tokens"], t["preemptions"]] for way, t in together.items()],
                f"{n} samples of {len(shared)} prompts: in a pool that holds them all, then in the lesson's "
                f"{budget_tokens // bs}-block budget (narrow-model replay):")
    return {"samples": n, "output_cap": cap, "prompts": alone, "predicted": {"grouped": g, "separate": sep},
            "measured": measured, "saving": 1 - measured["grouped"] / measured["separate"], "together": together,
            "served_by_model": real}


def paged_waste(block_size: int, life: float) -> float:  # the formula: (bs − 1)/2 empty slots per sequence
    return (block_size - 1) / 2 / (life + (block_size - 1) / 2)


def predict_waste(lesson, trace: list, budget_tokens: int) -> dict:
    """The formula on the trace's lengths: a sequence's mean length over its life, what a slab and a block waste
    of it, and how many paged sequences the budget holds against its slabs."""
    M, half = lesson.config.n_ctx, (BLOCK_SIZE - 1) / 2
    life = sum(len(r.prompt) * r.max_tokens + r.max_tokens ** 2 / 2 for r in trace) / sum(r.max_tokens for r in trace)
    f = {"life_mean_len": life, "paged_waste": paged_waste(BLOCK_SIZE, life), "contiguous_waste": 1 - life / M,
         "concurrency": min(budget_tokens / (life + half), len(trace)) / RESERVATIONS}
    predict(lesson, f"a sequence holds {life:.0f} tokens on average over its life: a max_model_len={M} slab wastes "
            f"1 − {life:.0f}/{M} = {f['contiguous_waste']:.0%} of itself, and {BLOCK_SIZE}-token blocks "
            f"{half:g} slots per sequence, {f['paged_waste']:.1%}; paging should fit {f['concurrency']:.1f}× the "
            "sequences while requests wait",
            expect={"paged_waste": f["paged_waste"], "concurrency": f["concurrency"], "shared_blocks": 1.0})
    return f


def measure(lesson, s: dict, trace: list, budget_tokens: int, budget_bytes: int) -> dict:
    """The trace served contiguous and paged, and paged by block size (a narrow model: counts need no width);
    with `real_model`, the two policies again through the lesson's model."""
    model, name = lesson.model, lesson.args.model
    narrow = narrow_model(model)
    with one_thread():
        runs = {policy: serve_in_budget(narrow, trace, budget_tokens, BLOCK_SIZE, slabs)
                for policy, slabs in POLICIES.items()}
        sweep = [{"block_size": bs, **serve_in_budget(narrow, trace, budget_tokens, bs)} for bs in s["block_sizes"]]
    real = {}
    if s["real_model"]:  # the same trace through the lesson's model: the same waste, and real tokens/s
        real = {policy: serve_in_budget(model, trace, budget_tokens, BLOCK_SIZE, slabs, desc=f"{policy}, {name}")
                for policy, slabs in POLICIES.items()}
    shown = real or runs
    print_table(["policy", "waste of allocated", "real / budget", "peak seqs", "sustained seqs", "steps", "preemptions"]
                + (["tokens/s", "time"] if real else []),
                [[p, f"{r['waste']:.1%}", f"{r['real_share_of_budget']:.1%}", r["peak_running"],
                  f"{r['sustained_running']:.1f}", r["steps"], r["preemptions"]]
                 + ([f"{r['throughput']:.1f}", f"{r['seconds']:.1f} s"] if real else []) for p, r in shown.items()],
                f"Contiguous vs paged (block {BLOCK_SIZE}), one {si(budget_bytes, 'B')} KV budget, "
                + (f"served by {name}:" if real else "replayed through the narrow model:"))
    print_table(["block", "waste", "peak seqs", "sustained seqs", "preemptions"],
                [[r["block_size"], f"{r['waste']:.1%}", r["peak_running"], f"{r['sustained_running']:.1f}",
                  r["preemptions"]] for r in sweep], "Block-size sweep (narrow-model replay of the same trace):")
    return {"runs": runs, "sweep": sweep, "real": real, "shown": shown}


def checks(figures: dict) -> list[Check]:
    """Three counts against the formula: paged waste within its band, the sequences paging sustains against
    contiguous slabs, and the blocks n samples of a prompt hold against block arithmetic."""
    c, p, pred, share, sweep = (figures[k] for k in ("contiguous", "paged", "predicted", "sharing", "block_sweep"))
    got, want, M, life = share["measured"], share["predicted"], figures["reservation_tokens"], pred["life_mean_len"]
    return [Check(f"paged waste, block {BLOCK_SIZE} (≤ {WASTE_BAND:g} × the formula's)", [p["waste"]],
                  WASTE_BAND * pred["paged_waste"], "<=", timed=False, fmt="{:.1%}", predicted=pred["paged_waste"],
                  key="paged_waste",
                  why=f"{p['waste']:.1%} of allocated memory held no token against (bs − 1)/2 slots of a {life:.0f}-"
                      f"token sequence, {pred['paged_waste']:.1%}: blocks stay allocated past their sequence's last "
                      f"token (the sweep: block {sweep[0]['block_size']} wastes {sweep[0]['waste']:.1%})"),
            Check("sustained concurrent sequences, paged ÷ contiguous",
                  [p["sustained_running"] / c["sustained_running"]], CONCURRENCY_FACTOR, ">=", timed=False,
                  fmt="{:.2f}", predicted=pred["concurrency"], key="concurrency",
                  why=f"slabs ran {c['sustained_running']:.1f} sequences and paging {p['sustained_running']:.1f} while "
                      f"requests waited ({p['preemptions']} preemptions): {life:.0f}-token sequences against {M}-token "
                      f"slabs leave paging room for at most {pred['concurrency']:.1f}× the sequences"),
            Check(f"KV blocks held by {share['samples']} samples sharing a prompt ÷ block arithmetic's",
                  [got["grouped"] / want["grouped"]], 1.0, "<=", timed=False, fmt="{:.2f}", predicted=1.0,
                  key="shared_blocks", why=f"{got['grouped']} blocks against the {want['grouped']} that sharing each "
                                           f"prompt's full blocks leaves ({got['separate']} unshared): no sharing")]


def facts(figures: dict) -> list[Fact]:
    """Beside the checks, against vLLM's figures: what the workload, not the mechanism, sets."""
    (lo, hi), share, pred = VLLM_CONTIGUOUS_WASTE, figures["sharing"], figures["predicted"]
    return [Fact("contiguous waste", figures["contiguous"]["waste"], pred["contiguous_waste"], "{:.3f}",
                 f"context: vLLM's paper measured {lo:.0%}–{hi:.0%} for earlier systems and under "
                 f"{PAGED_WASTE_LIMIT:.0%} for paging; the trace's lengths against M and the block set both"),
            Fact(f"KV blocks saved by {share['samples']} samples sharing a prompt", share["saving"],
                 1 - share["predicted"]["grouped"] / share["predicted"]["separate"], "{:.3f}",
                 f"context: vLLM's paper, {PAPER_SHARING_SAVING:.1%}–9.8%; the prompts' length against the outputs "
                 "sets it")]


def judge_claim(lesson, m: dict, figures: dict):
    """The checks and the facts; what sharing bought in one budget."""
    runs, real, share = m["runs"], m["real"], m["sharing"]
    got, want, t = share["measured"], share["predicted"], share["together"]
    verdict = judge("paging wastes only what half a block per sequence predicts, runs at least twice the sequences in "
                    "the same memory, and lets n samples of a prompt share its full blocks",
                    checks(figures), lesson.load(), facts=facts(figures))
    agree = got["grouped"] == want["grouped"] and got["separate"] == want["separate"] \
        and got["copies"] == sum(a["predicted_copies"] for a in share["prompts"])
    g, s = t["grouped"], t["separate"]
    verdict.notes.append(f"sharing: {got['grouped']} blocks against {got['separate']} and {got['copies']} copies, as "
                         f"block arithmetic predicted ({'yes' if agree else 'NO'}); together in one budget, "
                         f"{g['steps']} steps against {s['steps']} ({g['tokens_per_step']:.1f} against "
                         f"{s['tokens_per_step']:.1f} tokens per step, {g['preemptions']} against {s['preemptions']} "
                         f"preemptions, {g['prefill_tokens']} prefill tokens against {s['prefill_tokens']})")
    if share["served_by_model"]:
        rg, rs = share["served_by_model"]["grouped"], share["served_by_model"]["separate"]
        verdict.notes.append(f"sharing, served by {lesson.args.model} in the same budget: {rg['throughput']:.1f} "
                             f"tokens/s against {rs['throughput']:.1f} ({rg['throughput'] / rs['throughput']:.2f}×, "
                             "one run each, not judged)")
    if real:
        agree = all(abs(real[k]["waste"] - runs[k]["waste"]) < 1e-9 for k in runs)
        rc, rp = real["contiguous"], real["paged"]
        verdict.notes.append(f"served by {lesson.args.model}: the same waste as the narrow replay "
                             f"({'yes' if agree else 'NO'}); tokens/s {rp['throughput']:.1f} paged vs "
                             f"{rc['throughput']:.1f} contiguous ({rp['throughput'] / rc['throughput']:.2f}×, one run "
                             f"each, not judged) with {rp['sustained_running'] / rc['sustained_running']:.1f}× the "
                             "sequences running; lesson 04 shows what a bigger decode batch is worth on this device")
    print_verdict(verdict)
    return verdict


def plot(lesson, m: dict, figures: dict, verdict) -> None:
    shown, sweep, c = m["shown"], figures["block_sweep"], m["runs"]["contiguous"]
    fig, axes = plt.subplots(1, 4, figsize=(21, 4.5))
    for policy, color in (("contiguous", "C1"), ("paged", "C0")):
        snaps = shown[policy]["snapshots"]
        used = [(i, x) for i, x in enumerate(snaps) if x["allocated_tokens"]]
        axes[0].plot([i for i, _ in used], [x["real_tokens"] / x["allocated_tokens"] for _, x in used], color=color,
                     label=f"{policy}: {1 - shown[policy]['waste']:.0%} on average")
        axes[1].step(range(len(snaps)), [x["running"] for x in snaps], color=color, where="post",
                     label=f"{policy}: {shown[policy]['sustained_running']:.1f} while requests wait")
    axes[0].set(xlabel="engine step", ylabel="real tokens / allocated KV memory", ylim=(0, 1.05),
                title="share of allocated KV memory holding tokens")
    axes[1].axhline(CONCURRENCY_FACTOR * c["sustained_running"], color="k", ls=":",
                    label=f"the claim's line: {CONCURRENCY_FACTOR:g}× contiguous")
    axes[1].set(xlabel="engine step", ylabel="running sequences", ylim=(0, None),
                title="concurrency in the same budget")
    axes[1].yaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].legend(fontsize=8, loc="center right")
    axes[1].legend(fontsize=8, loc="upper right")
    labels = [str(r["block_size"]) for r in sweep]
    axes[2].bar(labels, [100 * r["waste"] for r in sweep], color="C0", label="paged, by block size")
    axes[2].plot(labels, [100 * r["predicted_waste"] for r in sweep], "x", color="navy", ms=9,
                 label="the formula: (bs − 1)/2 slots of a sequence")
    axes[2].axhline(100 * c["waste"], color="C1", ls="--", label=f"contiguous: {c['waste']:.0%}")
    axes[2].axhline(100 * PAGED_WASTE_LIMIT, color="k", ls=":", label=f"vLLM's paper: under {PAGED_WASTE_LIMIT:.0%}")
    axes[2].set(xlabel="block size (tokens)", ylabel="waste (% of allocated KV memory)", ylim=(0, 100),
                title="internal fragmentation by block size")
    axes[2].legend(fontsize=8, loc="upper left")
    for way, color in (("separate", "C1"), ("grouped", "C0")):
        t = m["sharing"]["together"][way]
        axes[3].step(range(1, len(t["blocks_held"]) + 1), t["blocks_held"], color=color, where="post",
                     label=f"{way}: {t['steps']} steps, {t['tokens_per_step']:.1f} tokens/step")
    axes[3].set(xlabel="engine step", ylabel="KV blocks held", ylim=(0, None),
                title=f"{m['sharing']['samples']} samples of each prompt, one budget")
    axes[3].legend(fontsize=8, loc="upper right")
    save_plot(lesson, fig, verdict)


def main(argv=None) -> dict:
    args = make_parser(__doc__).parse_args(argv)
    lesson = start(NAME, args, ceilings=False)
    cfg, M = lesson.config, lesson.config.n_ctx
    trace = lognormal_trace(REQUESTS, M, cfg.vocab_size, prompt_median=M * 5 / 32, output_median=M / 16, seed=0)
    stats, budget_tokens = describe_trace(trace), RESERVATIONS * M
    budget_bytes = budget_tokens * cfg.kv_bytes_per_token(lesson.dtype)
    print(f"trace: {stats['requests']} requests, prompt mean {stats['prompt_mean']:.0f} (max {stats['prompt_max']}), "
          f"output mean {stats['output_mean']:.0f} (max {stats['output_max']}), all queued at t = 0\nKV budget: "
          f"{RESERVATIONS} slabs of max_model_len={M} = {budget_tokens:,} tokens = {si(budget_bytes, 'B')}\n")
    predicted = predict_waste(lesson, trace, budget_tokens)
    sizes = {"block_sizes": [1, 4, 16, 64] if args.quick else [1, 4, 8, 16, 32, 64, 128], "real_model": not args.quick}
    m = measure(lesson, sizes, trace, budget_tokens, budget_bytes)
    m["sharing"] = sharing(lesson, trace, budget_tokens, 16 if args.quick else None, not args.quick)
    figures = {"trace": stats, "budget_tokens": budget_tokens, "budget_bytes": budget_bytes, "reservation_tokens": M,
               "predicted": predicted, "contiguous": m["runs"]["contiguous"], "paged": m["runs"]["paged"],
               "block_sweep": [{"predicted_waste": paged_waste(r["block_size"], predicted["life_mean_len"]),
                                **{k: r[k] for k in ("block_size", "waste", "peak_running", "sustained_running",
                                                     "preemptions")}} for r in m["sweep"]],
               "served_by_model": m["real"], "sharing": m["sharing"]}
    verdict = judge_claim(lesson, m, figures)
    plot(lesson, m, figures, verdict)
    write_results(lesson, figures, verdict)
    return {"figures": figures, "verdict": verdict}


if __name__ == "__main__":
    run(main)
