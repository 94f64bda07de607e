"""Lesson 14's models: the pair it speculates with (a target with trained weights and its draft), and why; and
what their passes cost and their generations take, timed (`cost_fns`, `summarise_costs`, `timed`); how much of
a generation is the loop's own work, outside its forward passes (`forward_clock`); and a sweep's row, with S
priced at measured costs (`priced`, `sweep_row`).

Acceptance rates need trained weights: a random init's next token barely depends
on its context, so its α says nothing about speculation. With a checkpoint on disk
the lesson speculates with it; without one, with a small model it trains here in
seconds (`train_small`) on text that ships with every Python: the docstrings of a
few standard-library modules, byte by byte.

A draft must propose the target's tokens, so it needs the target's vocabulary.
The classic pairs share GPT-2's tokenizer: distilgpt2 drafts for gpt2, gpt2 for
the larger ones. Without their weights on disk, the draft is the target's own
first quarter of blocks, sharing (not copying) its weights: cheap to make, and
right as often as those blocks already agree with the whole model.
"""
from __future__ import annotations

import ast
import contextlib
import dataclasses
import statistics
import sysconfig
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from minillm.bench.steps import decode_step
from minillm.checkpoints.load import load_model, locate
from minillm.config import GPT2Config
from minillm.cpu_layout import choose_layout  # as the loader lays out every model it loads
from minillm.device import synchronize
from minillm.kv_cache import KVCache, Segment, generate
from minillm.model import GPT2, Conv1D
from minillm.sampling_params import SamplingParams
from minillm.speculative import (NgramProposer, SpecDecodingStats, SpeculativeDecoder, expected_speedup,
                                 expected_tokens_per_pass)

TEXT_MODULES = ("argparse", "textwrap", "statistics", "difflib", "fractions", "calendar", "string", "shlex")
SMALL = GPT2Config(n_layer=2, n_head=4, n_embd=64, n_ctx=128, vocab_size=256, eos_token_id=None)  # bytes in, bytes out


def shallow_draft(target: GPT2, n_layer: int) -> GPT2:
    """The target's first n_layer blocks, its embeddings, ln_f and tied head (in the layout the loader chose for the
    target): a draft sharing (not copying) them."""
    with torch.device("meta"):
        draft = GPT2(target.config.with_(n_layer=n_layer), seed=None)
    draft.wte, draft.wpe, draft.ln_f = target.wte, target.wpe, target.ln_f
    draft.lm_head = target.lm_head  # in the layout the loader chose for the target, shared
    draft.h = torch.nn.ModuleList(target.h[:n_layer])
    draft.weights_source = f"the target's first {n_layer} of {target.config.n_layer} blocks"
    return draft.eval()


CLASSIC_DRAFTS = {"gpt2": "distilgpt2", "gpt2-medium": "gpt2", "gpt2-large": "gpt2", "gpt2-xl": "gpt2"}


def has_weights(name: str) -> bool:
    """Whether `name` is a checkpoint whose weights are on disk (a preset folder holding safetensors)."""
    with contextlib.suppress(ValueError):
        folder, _ = locate(name)
        return folder.is_dir() and any(folder.glob("*.safetensors"))
    return False


def choose_draft(target: GPT2, target_name: str, asked: str, device, dtype) -> tuple[GPT2, str]:
    """The draft model and why: `asked` may name any checkpoint with the target's vocabulary; `auto` takes the
    classic pair (distilgpt2 for gpt2, gpt2 for the larger ones) when its weights are present, else the shallow
    draft; `shallow` always takes the target's first quarter of blocks."""
    shallow, classic = max(1, target.config.n_layer // 4), CLASSIC_DRAFTS.get(target_name)
    if asked == "shallow" or (asked == "auto" and not has_weights(classic or "")):
        why = ("asked for (--draft shallow)" if asked == "shallow" else f"no weights for the classic draft {classic} "
               f"of {target_name}" if classic else f"{target_name} has no classic draft")
        return shallow_draft(target, shallow), f"the target's first {shallow} block{'s' * (shallow > 1)} ({why})"
    name = classic if asked == "auto" else asked
    draft = load_model(name, device, dtype)
    if draft.config.vocab_size != target.config.vocab_size:
        raise SystemExit(f"--draft {name}: its vocabulary has {draft.config.vocab_size} tokens and the target's "
                         f"{target.config.vocab_size}; a draft must propose the target's tokens: pick a checkpoint "
                         "of the same tokenizer, or --draft shallow")
    return draft, f"{name} ({draft.weights_source}{', the classic pair' if asked == 'auto' else ''})"


def training_text() -> bytes:
    """The docstrings of TEXT_MODULES (the standard library's own sources), as ASCII bytes."""
    lib, docs = Path(sysconfig.get_paths()["stdlib"]), []
    for name in TEXT_MODULES:
        tree = ast.parse((lib / f"{name}.py").read_text())
        docs += [d for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef))
                 and (d := ast.get_docstring(n))]
    return "\n\n".join(docs).encode("ascii", "replace")


def train_small(steps: int, seed: int = 0, batch: int = 16, length: int = 64) -> GPT2:
    """SMALL trained for `steps` steps of AdamW on `training_text()` (next byte, cross-entropy), on the CPU; its
    weights_source says how, with the loss before and after."""
    data, g = torch.tensor(list(training_text())), torch.Generator().manual_seed(seed)
    model = GPT2(SMALL, seed=seed)
    opt, losses = torch.optim.AdamW(model.parameters(), lr=3e-3), []
    for _ in range(steps):
        ix = torch.randint(0, len(data) - length - 1, (batch,), generator=g).tolist()
        x, y = (torch.stack([data[i + o:i + o + length] for i in ix]) for o in (0, 1))
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    last = sum(losses[-20:]) / len(losses[-20:])
    model.weights_source = (f"trained here: {steps} steps of AdamW on {len(data):,} bytes of the docstrings of Python's "
                            f"{', '.join(TEXT_MODULES)} (loss {losses[0]:.2f} → {last:.2f} nats per byte)")
    return model.eval().requires_grad_(False)


def is_trained(model: GPT2) -> bool:
    """Whether the weights came from a checkpoint or training, not a random init."""
    return not model.weights_source.startswith("random-init")


def quoting_prompt(target: GPT2, passage: list[int], quoted: int) -> list[int]:
    """A passage, the target's greedy continuation of it, and the passage again."""
    greedy = SamplingParams(temperature=0.0, max_tokens=quoted, ignore_eos=True)
    return passage + generate(target, [passage], greedy)[0] + passage


def speculation_pair(lesson, args, s: dict) -> tuple[GPT2, GPT2, list[int], str]:
    """The target and draft the lesson speculates with, a passage, and why: the --model's own weights and the
    chosen draft when they are trained, else a small model trained here and its first block (drafts.py)."""
    if is_trained(lesson.model):
        draft, why = choose_draft(lesson.model, args.model, args.draft, lesson.device, lesson.dtype)
        text = torch.randint(0, lesson.config.vocab_size, (s["passage"],), generator=torch.Generator().manual_seed(0))
        return lesson.model, draft, text.tolist(), f"target {args.model} ({lesson.model.weights_source}); draft {why}"
    target = choose_layout(train_small(s["train_steps"], length=s["train_length"]).to(lesson.device, lesson.dtype))
    passage = list(training_text()[1000:1000 + s["passage"]])
    return target, shallow_draft(target, 1), passage, (
        f"{args.model} has no trained weights here ({lesson.model.weights_source}), and acceptance rates need them: a "
        f"random init's α says nothing about speculation. So this run speculates with a {SMALL.n_layer}-block, "
        f"{SMALL.n_embd}-wide model over bytes, {target.weights_source}, and its first block as the draft "
        f"(`python weights_download.py {args.model}` to speculate with the real one)")


def cost_fns(target: GPT2, draft: GPT2, ks: list[int], context: int, lookup_gamma: int = 4) -> dict:
    """Target passes over k new tokens after `context` cached ones (caches declared filled: time does not depend on
    the values), logits at all k; their matrix products alone (projections, LM head); a draft step; a lookup."""
    cfg, device, g = target.config, target.device, torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (context + max(ks),), generator=g).tolist()
    ids = torch.tensor([tokens[context:]], device=device)
    layers = [m for m in target.modules() if isinstance(m, Conv1D)]
    xs = {n: torch.randn(max(ks), n, generator=g).to(device, target.dtype) for n in {m.weight.shape[0] for m in layers}}

    def verify(k: int):
        cache, rows = KVCache(cfg, 1, context + k, device, target.dtype), torch.arange(k, device=device)
        return torch.inference_mode()(lambda: target(ids[:, :k], cache.prepare([Segment(0, context, k)]).positions,
                                                     cache=cache, logits_indices=rows))

    def matmuls(k: int):
        return torch.inference_mode()(lambda: [m(xs[m.weight.shape[0]][:k]) for m in layers]
                                      + [torch.nn.functional.linear(xs[cfg.n_embd][:k], target.wte.weight)])

    lookup, greedy = NgramProposer(), SamplingParams(temperature=0.0)   # random tokens: no match, all scanned
    return {**{f"pass {k}": verify(k) for k in ks}, **{f"matmuls {k}": matmuls(k) for k in ks},
            "draft step": decode_step(draft, context),
            "lookup": lambda: lookup.propose(tokens[:context], lookup_gamma, greedy, None)}


def summarise_costs(costs, ks: list[int]) -> dict:
    """Each pass (and its matrix products) ÷ k = 1's, round by round and median; their times; c for each draft."""
    rounds = {k: costs.ratio(f"pass {k}", "pass 1") for k in ks}
    return {"rounds": rounds, "ratio": {k: statistics.median(r) for k, r in rounds.items()},
            "matmul_ratio": {k: statistics.median(costs.ratio(f"matmuls {k}", "matmuls 1")) for k in ks},
            "seconds": {what: {k: costs.median(f"{what} {k}") for k in ks} for what in ("pass", "matmuls")},
            "c": {"model draft": statistics.median(costs.ratio("draft step", "pass 1")),
                  "prompt lookup": statistics.median(costs.ratio("lookup", "pass 1"))}}


class Run(NamedTuple):
    tokens: list[int]
    decode_s: float       # the decode phase: from the first token (the prefill's) to the last
    decode_tokens: int    # tokens made in it
    stats: object         # SpecDecodingStats of the same rounds (the prefill's left out); None for the target alone
    inside_s: float | None = None   # of decode_s, inside forward passes and their `prepare` (`timed(clock=True)`)


@contextlib.contextmanager
def forward_clock(models: list[GPT2], device):
    """Yields [seconds] spent so far inside the models' forward passes, every KV cache's `prepare` (a pass's
    metadata) and prompt lookup's `propose` (what the passes and the lookup timed alone include), the device
    synchronised at each boundary: the rest of a span is the loop's own work (sampling, verifying, bookkeeping)."""
    spent, open_ = [0.0], []   # open_: the clock's start, once per clocked call still running
    methods = [(KVCache, "prepare"), (NgramProposer, "propose")]
    saved = [getattr(cls, name) for cls, name in methods]

    def enter(*_):
        if not open_:
            synchronize(device)
        open_.append(time.perf_counter())

    def leave(*_):
        start = open_.pop()
        if not open_:   # the outermost call ended (one model hooked twice, a draft that is the target)
            synchronize(device)
            spent[0] += time.perf_counter() - start

    def clocked(method):
        def call(self, *args, **kwargs):
            enter()
            try:
                return method(self, *args, **kwargs)
            finally:
                leave()
        return call
    hooks = [h for m in models for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    for (cls, name), method in zip(methods, saved):
        setattr(cls, name, clocked(method))
    try:
        yield spent
    finally:
        for (cls, name), method in zip(methods, saved):
            setattr(cls, name, method)
        for h in hooks:
            h.remove()


def timed(target: GPT2, draft, prompt: list[int], params: SamplingParams, gamma: int = 0, generations: int = 1,
          clock: bool = False):
    """`generations` generations in a row, their decode phases timed and counted (not the prefill's round) and
    summed, so that a round lasts long enough for a moment's load to be a small share of it: the target alone if
    draft is None. clock: also the seconds inside the forward passes (`forward_clock`), in `inside_s`."""
    models = [target] + ([draft] if isinstance(draft, GPT2) else [])

    def one() -> Run:
        with forward_clock(models, target.device) if clock else contextlib.nullcontext([None]) as inside:
            if draft is None:
                marks = []   # on_step fires after the prefill, then after every decode step
                out = generate(target, [prompt], params,
                               on_step=lambda *_: marks.append((time.perf_counter(), inside[0])))[0]
                (t0, in0), (t1, in1) = marks[0], marks[-1]
                return Run(out, t1 - t0, len(out) - 1, None, None if in0 is None else in1 - in0)
            decoder = SpeculativeDecoder(target, draft, prompt, params, gamma)
            first, t0, in0 = len(decoder.step()), time.perf_counter(), inside[0]   # the first round: the prefill
            before = dataclasses.astuple(decoder.stats)
            while decoder.finish_reason is None:
                decoder.step()
            seconds, in1, after = time.perf_counter() - t0, inside[0], dataclasses.astuple(decoder.stats)
        return Run(decoder.output, seconds, len(decoder.output) - first,
                   SpecDecodingStats(*(a - b for a, b in zip(after, before))), None if in0 is None else in1 - in0)

    def once() -> Run:   # greedy: every generation makes the same tokens; times and counts are summed
        runs = [one() for _ in range(generations)]
        stats = None if draft is None else SpecDecodingStats(*map(sum, zip(*(dataclasses.astuple(r.stats)
                                                                             for r in runs))))
        return runs[-1]._replace(decode_s=sum(r.decode_s for r in runs), stats=stats,
                                 decode_tokens=sum(r.decode_tokens for r in runs),
                                 inside_s=None if not clock else sum(r.inside_s for r in runs))
    return once


def priced(per_pass: float, guesses: float, c: float, ratio: dict, loop: float = 0.0, alone: float = 0.0) -> float:
    """S: tokens per pass ÷ a pass's cost in target-alone steps (1 + ℓ₀ passes timed alone): ḡ draft steps of c,
    v(ḡ + 1) read between the measured k, and ℓ of the loop's own work."""
    ks = sorted(ratio)
    return per_pass * (1 + alone) / (guesses * c + float(np.interp(guesses + 1, ks, [ratio[k] for k in ks])) + loop)


def sweep_row(name: str, gamma: int, base: list[Run], runs: list[Run], clocked: tuple[Run, Run], own: dict,
              shape: dict) -> dict:
    """One draft at one γ on the pair: α, tokens and guesses per pass (ḡ: lookup may propose fewer than γ), the
    speedup per round (per-token time ratio); ℓ₀ and ℓ, the loop's seconds outside the passes per step (target
    alone) and per pass (speculating) in the `clocked` runs, ÷ a pass over 1 token timed alone; S at v = 1
    (Leviathan's, beside its value at γ), S at the pair's own costs (`modelled`, which the speedup is judged
    against: `fit`), and at the shape's: each S from the formula's tokens per pass, not the run's."""
    stats = runs[0].stats   # of the timed rounds; greedy: every round made the same tokens, so the same counts
    speedups = [(b.decode_s / b.decode_tokens) / (r.decode_s / r.decode_tokens) for b, r in zip(base, runs)]
    passes = stats.num_target_passes
    per_pass, guesses = runs[0].decode_tokens / passes, stats.num_draft_tokens / passes
    formula, c, c_predicted = expected_tokens_per_pass(stats.alpha, guesses), own["c"][name], shape["c_predicted"][name]
    (b, r), t1 = clocked, own["seconds"]["pass"][1]
    alone_s, loop_s = (b.decode_s - b.inside_s) / b.decode_tokens, (r.decode_s - r.inside_s) / r.stats.num_target_passes
    modelled, at = priced(formula, guesses, c, own["ratio"], loop_s / t1, alone_s / t1), shape["seconds"]["pass"][1]
    return {"draft": name, "gamma": gamma, "alpha": stats.alpha, "c": c, "speedups": speedups,
            "speedup": statistics.median(speedups), "low": min(speedups), "high": max(speedups),
            "tokens_per_pass": per_pass, "formula_tokens_per_pass": formula, "guesses_per_pass": guesses,
            "loop": loop_s / t1, "loop_alone": alone_s / t1, "predicted": expected_speedup(stats.alpha, guesses, c),
            "leviathan_at_gamma": expected_speedup(stats.alpha, gamma, c), "modelled": modelled,
            "fit": [x / modelled for x in speedups], "c_shape": shape["c"][name],
            "at_shape": priced(formula, guesses, shape["c"][name], shape["ratio"], loop_s / at, alone_s / at),
            "at_shape_predicted": priced(formula, guesses, c_predicted, shape["predicted_ratio"], loop_s / at,
                                         alone_s / at)}
