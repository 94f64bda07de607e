"""Lesson 14 (speculative decoding): its run, its draft, its timing of the decode phase, and its verdict.

The --quick run uses the `tiny` model, so its timings are noise; what it must
get right regardless is the shape of its results and one verdict. The draft,
the prompt and the timed runs are checked on a model whose tokens depend on
their context; the verdict's pieces are fed numbers on both sides of each line.
"""
import json

import pytest
import torch

from minillm import SamplingParams, kv_cache
from minillm.speculative import NgramProposer, SpecDecodingStats, expected_tokens_per_pass
from models import context_model, random_prompts

from lesson_checks import assert_lesson_results
from lessons_support import load_lesson  # also puts lessons/ on sys.path

from minillm.bench.verdict import HOLDS, INCONCLUSIVE, NOT_SUPPORTED, interleave  # noqa: E402


lesson = load_lesson("14_speculative_decoding")
import drafts  # noqa: E402  (lessons/drafts.py)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def target():
    return context_model()


def test_quick_run_on_tiny_writes_one_verdict(tmp_path, one_thread):
    lesson.main(["--model", "tiny", "--device", "cpu", "--quick", "--out", str(tmp_path)])
    doc = json.loads((tmp_path / f"{lesson.NAME}.json").read_text())
    assert doc["lesson"] == lesson.NAME and doc["quick"] is True
    assert (tmp_path / f"{lesson.NAME}.png").stat().st_size > 1000
    assert doc["verdict"]["outcome"] in (HOLDS, NOT_SUPPORTED, INCONCLUSIVE)
    rows = doc["figures"]["sweep"]
    assert [(r["draft"], r["gamma"]) for r in rows] == [(d, g) for d in ("model draft", "prompt lookup") for g in [4]]
    for r in rows:
        assert 0 <= r["alpha"] <= 1 and 1 <= r["tokens_per_pass"] <= r["gamma"] + 1 and len(r["speedups"]) >= 5
        assert r["fit"] == pytest.approx([x / r["modelled"] for x in r["speedups"]]) and r["at_shape"] > 0
        assert r["loop"] > 0 and r["loop_alone"] > 0   # the loop's own work, clocked
        formula = expected_tokens_per_pass(r["alpha"], r["guesses_per_pass"])   # what S takes, not the run's own
        assert r["formula_tokens_per_pass"] == pytest.approx(formula)
    for who, blocks in (("verification", None), ("shape", 1)):   # the pair, and tiny's shape (2 blocks: a draft of 1)
        cost = doc["figures"][who]
        assert cost["ratio"]["1"] == 1.0 and set(cost["ratio"]) == {"1", "5"} and cost["context"] <= 128 - 5
        assert cost["premise_band"][0] < cost["predicted_ratio"]["5"] < cost["premise_band"][1]
    assert doc["figures"]["shape"]["blocks"] == 1 and doc["figures"]["shape"]["c_predicted"]["prompt lookup"] == 0
    names = [f["name"].split(",")[0] for f in doc["verdict"]["facts"]]
    assert names.count("S at tiny's shape") == 2 and names.count("ℓ") == 2 and names.count("ℓ₀") == 1
    low_judged = doc["figures"]["shape"]["premise_band"][0] > 1   # else reported: it cannot fail
    assert ("premise_low" in [c["key"] for c in doc["verdict"]["checks"]]) == low_judged
    assert names.count("on tiny's shape") == (not low_judged) and len(doc["verdict"]["checks"]) == 4 + low_judged
    assert_lesson_results(doc)


def test_the_shallow_draft_shares_the_targets_weights_and_runs_its_first_blocks(target, one_thread):
    ids = torch.tensor([random_prompts(1, [20], seed=3)[0]])
    whole = drafts.shallow_draft(target, target.config.n_layer)
    torch.testing.assert_close(whole(ids), target(ids), rtol=0, atol=0)
    one = drafts.shallow_draft(target, 1)
    assert one.h[0] is target.h[0] and one.wte.weight.data_ptr() == target.wte.weight.data_ptr()
    assert one.config.n_layer == 1 and len(one.h) == 1 and one.device == target.device
    with torch.inference_mode():   # the first block, then the target's own ln_f and head
        x = target.h[0](target.wte(ids) + target.wpe(torch.arange(ids.shape[1])))
        torch.testing.assert_close(one(ids), torch.nn.functional.linear(target.ln_f(x), target.wte.weight))
    assert not torch.allclose(one(ids), target(ids), atol=1e-2)   # a context model: the later blocks matter


def test_the_shallow_draft_reads_its_head_in_the_targets_layout():
    from minillm.cpu_layout import choose_layout, linears_layout, lm_head_layout
    target = choose_layout(context_model())
    draft = drafts.shallow_draft(target, 1)
    assert lm_head_layout(draft) == lm_head_layout(target) and draft.lm_head is target.lm_head
    assert linears_layout(draft) == linears_layout(target)
    numpy_blas = choose_layout(context_model(), numpy_one_row=True)   # one row through numpy
    assert lm_head_layout(drafts.shallow_draft(numpy_blas, 1)) == lm_head_layout(numpy_blas)


def test_the_prompt_quotes_the_targets_own_continuation(target, one_thread):
    prompt = drafts.quoting_prompt(target, random_prompts(1, [10], seed=4)[0], quoted=6)
    text, quoted = prompt[:10], prompt[10:16]
    assert len(prompt) == 26 and prompt[16:] == text
    assert quoted == kv_cache.generate(target, [text], SamplingParams(temperature=0.0, max_tokens=6,
                                                                      ignore_eos=True))[0]


def test_timed_runs_time_the_decode_phase_and_give_the_targets_tokens(target, one_thread):
    prompt = random_prompts(1, [15], seed=6)[0]
    want = kv_cache.generate(target, [prompt], GREEDY)[0]
    base = drafts.timed(target, None, prompt, GREEDY)()
    assert base.tokens == want and base.decode_tokens == GREEDY.max_tokens - 1
    assert base.stats is None and base.decode_s > 0
    same = drafts.timed(target, target, prompt, GREEDY, 3)()   # the target as its own draft: every guess accepted
    assert same.tokens == want and same.stats.alpha == 1.0
    assert same.decode_tokens == GREEDY.max_tokens - 4   # the first round, untimed, made γ + 1 = 4 tokens
    assert same.stats.num_target_passes == 2   # then two rounds of 4 tokens, counted as they are timed
    lookup = drafts.timed(target, NgramProposer(), prompt, GREEDY, 4)()
    assert lookup.tokens == want and lookup.stats.num_draft_passes == 0
    three = drafts.timed(target, target, prompt, GREEDY, 3, generations=3)()   # three in a row, summed
    assert three.tokens == want and three.decode_tokens == 3 * (GREEDY.max_tokens - 4) and three.decode_s > 0
    assert three.stats.num_target_passes == 6 and three.stats.num_accepted_tokens == 3 * 2 * 3   # summed


def run(seconds: float, tokens: int, stats=None, inside=None):
    return drafts.Run([0] * (tokens + 1), seconds, tokens, stats, inside)


def test_a_sweep_row_judges_leviathans_formula_in_alpha_not_the_runs_own_tokens_per_pass():
    """2 guesses per pass at γ = 3 (lookup proposes fewer when it finds nothing), α = 0.75: S takes (1 − α³) / (1 − α)
    tokens per pass, 2.31, whatever the run made (1.0 here), priced at the pair's own costs, ḡc + v(ḡ + 1) + ℓ, in
    target-alone steps of 1 + ℓ₀; ℓ and ℓ₀ are the clocked runs' seconds outside the passes ÷ a pass over 1 timed
    alone. So a speedup that only matches the run's own tokens per pass is judged off the formula."""
    stats = SpecDecodingStats(num_draft_tokens=20, num_accepted_tokens=15, num_rejections=5, num_target_passes=10)
    base = [run(1.0, 10), run(2.0, 10)]                    # 0.1 s and 0.2 s per token
    spec = [run(2.0, 10, stats), run(2.0, 5, stats)]       # 0.2 s and 0.4 s per token
    # clocked: the target alone 0.3 s outside its passes over 10 steps, speculation 0.8 s over its 10 passes
    clocked = (run(1.0, 10, None, inside=0.7), run(2.0, 10, stats, inside=1.2))
    own = {"c": {"model draft": 0.25}, "ratio": {1: 1.0, 3: 1.5, 5: 2.5}, "seconds": {"pass": {1: 0.1}}}
    shape = {"c": {"model draft": 0.5}, "ratio": {1: 1.0, 5: 1.2}, "c_predicted": {"model draft": 0.4},
             "predicted_ratio": {1: 1.0, 5: 1.1}, "seconds": {"pass": {1: 0.2}}}
    row = drafts.sweep_row("model draft", 3, base, spec, clocked, own, shape)
    assert row["speedups"] == pytest.approx([0.5, 0.5]) and row["alpha"] == 0.75 and row["c"] == 0.25
    assert row["guesses_per_pass"] == 2.0 and row["tokens_per_pass"] == 1.0   # the timed rounds' tokens ÷ passes
    per_pass = expected_tokens_per_pass(0.75, 2.0)   # (1 − α³) / (1 − α)
    assert row["formula_tokens_per_pass"] == pytest.approx(per_pass) == pytest.approx((1 - 0.75 ** 3) / 0.25)
    assert row["predicted"] == pytest.approx(per_pass / 1.5)   # ḡc + 1 = 1.5
    assert row["leviathan_at_gamma"] == pytest.approx(expected_tokens_per_pass(0.75, 3) / 1.75)
    assert row["loop_alone"] == pytest.approx(0.3) and row["loop"] == pytest.approx(0.8)   # 0.03 s, 0.08 s ÷ 0.1 s
    # the formula's tokens per pass ÷ (2 guesses at c + a pass over 3 tokens: 1.5× + ℓ), in steps of 1 + ℓ₀
    assert row["modelled"] == pytest.approx(per_pass * 1.3 / (2 * 0.25 + 1.5 + 0.8))
    assert row["fit"] == pytest.approx([0.5 / row["modelled"]] * 2) and row["fit"][0] < 1 / (1 + lesson.FIT)
    # the run's own accounting, 1 token per pass ÷ (ḡc + v), matches its speedup exactly; it is not what is judged
    assert row["speedup"] == pytest.approx(row["tokens_per_pass"] / (2 * 0.25 + 1.5))
    # at the shape's: 2 guesses at 0.5 + a pass over 3, halfway from 1.0 to 1.2 (measured) or to 1.1 (predicted);
    # the loop's seconds carried over, ÷ the shape's pass over 1 (0.2 s)
    assert row["at_shape"] == pytest.approx(per_pass * 1.15 / (2 * 0.5 + 1.1 + 0.4)) and row["c_shape"] == 0.5
    assert row["at_shape_predicted"] == pytest.approx(per_pass * 1.15 / (2 * 0.4 + 1.05 + 0.4))
    other = drafts.sweep_row("model draft", 3, base, spec, clocked, {**own, "ratio": {1: 1.0, 5: 2.0}}, shape)
    assert other["modelled"] == pytest.approx(row["modelled"])   # v(3) read between k = 1 and 5: 1.5 again


def test_the_clock_splits_a_generation_into_its_passes_and_the_loops_own_work(target, monkeypatch, one_thread):
    """Work put inside the forward passes or a lookup's proposal (drafting, priced by c) counts as inside; work put
    in the loop (the acceptance rule) as outside; the hooks and the clocked methods are gone afterwards."""
    import time

    import minillm.speculative as spec
    prompt, nap, prepare = random_prompts(1, [15], seed=6)[0], 0.004, kv_cache.KVCache.prepare
    monkeypatch.setattr(spec, "verify", lambda *a, verify=spec.verify: (time.sleep(nap), verify(*a))[1])
    plain = drafts.timed(target, None, prompt, GREEDY, clock=True)()
    loop = drafts.timed(target, target, prompt, GREEDY, 3, clock=True)()
    assert plain.stats is None and 0 < plain.inside_s < plain.decode_s
    assert loop.decode_s - loop.inside_s >= nap * loop.stats.num_target_passes   # the rule's nap: outside
    assert kv_cache.KVCache.prepare is prepare and not target._forward_hooks and not target._forward_pre_hooks
    propose = NgramProposer.propose   # a lookup is drafting (its c), not the loop's own work: inside
    monkeypatch.setattr(NgramProposer, "propose", lambda *a, propose=propose: (time.sleep(nap), propose(*a))[1])
    lookup = drafts.timed(target, NgramProposer(), prompt, GREEDY, 3, clock=True)()
    assert lookup.inside_s >= nap * (lookup.stats.num_target_passes - 1)   # the last round may propose nothing
    assert NgramProposer.propose is not propose and NgramProposer.propose.__name__ == "<lambda>"   # restored
    monkeypatch.setattr(target, "forward",
                        lambda *a, forward=target.forward, **k: (time.sleep(nap), forward(*a, **k))[1])
    slow = drafts.timed(target, None, prompt, GREEDY, clock=True)()   # a pass made slower by a nap: inside
    assert slow.inside_s >= nap * slow.decode_tokens and slow.decode_s - slow.inside_s < slow.inside_s
    assert drafts.timed(target, None, prompt, GREEDY)().inside_s is None   # unclocked: not measured


def figures(premise=(1.1,) * 5, fit=(1.0,) * 5, lookup=(1.0,) * 5, band=(0.7, 1.575), predicted=1.05):
    """What the lesson writes: the premise predicted at 1.05, its band 0.7–1.575 (its low end under 1: reported, not
    judged), the given rounds; the pair's fits."""
    shape = {**cost({1: 1.0, 2: 1.05, 5: 1.1}, [10, 10.5, 11], [8, 8.2, 8.5]), "premise_band": list(band),
             "predicted_ratio": {1: 1.0, 5: predicted}, "rounds": {lesson.PREMISE_K: list(premise)}}
    rows = [{**r, "fit": list(lookup if r["draft"] == "prompt lookup" else fit)} for r in sweep(1.8, 1.8, 3.0)]
    return {"model": "gpt2", "shape": shape, "sweep": rows}


def test_each_check_can_fail():
    """The premise over its band's high end, or under its low end where that is over 1 (a compute-bound shape); the
    model draft's fit to S at the pair's own costs under FIT_BAND's low end or over its high end; lookup's fit under
    the low end: each NOT SUPPORTED, and only that check; the predictions ride along (the fits' is 1: ratios to S)."""
    checks = lesson.checks(figures())
    assert [c.outcome() for c in checks] == [HOLDS] * 4   # the low end, 0.7, is no check: no pass costs under a step
    low, high = 1 / 1.15, 1.15
    assert [c.line for c in checks] == [1.575, pytest.approx(low), high, pytest.approx(low)]
    assert [c.predicted for c in checks] == [1.05, 1.0, 1.0, 1.0]
    assert [c.key for c in checks] == ["premise_high", "fit_low", "fit_high", "lookup"]
    for i, bad in enumerate([{"premise": [2.2] * 5}, {"fit": [0.8] * 5}, {"fit": [1.2] * 5}, {"lookup": [0.8] * 5}]):
        outcomes = [c.outcome() for c in lesson.checks(figures(**bad))]
        assert {j for j, o in enumerate(outcomes) if o == NOT_SUPPORTED} == {i}, (bad, outcomes)
    assert lesson.checks(figures(premise=[1.5, 1.55, 1.6, 1.65, 1.5]))[0].outcome() == INCONCLUSIVE
    compute = dict(band=(1.2, 2.7), predicted=1.8)   # a band whose low end is over 1: the premise's low end judged
    assert [c.key for c in lesson.checks(figures(premise=[1.9] * 5, **compute))][:2] == ["premise_low", "premise_high"]
    outcomes = [c.outcome() for c in lesson.checks(figures(premise=[1.1] * 5, **compute))]
    assert outcomes == [NOT_SUPPORTED] + [HOLDS] * 4


def test_the_facts_report_c_the_pairs_own_cost_the_loops_work_and_s_at_the_shape_never_judged():
    """Beside the checks: c at the shape, the pair's own pass cost, the premise while its band's low end is ≤ 1 (it
    cannot fail there), ℓ₀ and each row's ℓ (S's loop work), and S at the shape for each row."""
    f = {**figures(), "verification": {"ratio": {1: 1.0, 5: 2.2}, "predicted_ratio": {5: 1.04}}}
    f["shape"].update(blocks=3, c={"model draft": 0.45, "prompt lookup": 0.001},
                      c_predicted={"model draft": 0.48, "prompt lookup": 0.0})
    for r in f["sweep"]:
        r.update(at_shape=1.9, at_shape_predicted=2.0)
    facts = lesson.facts(f)
    assert [(x.value, x.predicted) for x in facts] == [(0.45, 0.48), (2.2, 1.04), (1.1, 1.05), (0.3, None),
                                                       (0.5, None), (0.6, None), (1.9, 2.0), (1.9, 2.0)]
    assert facts[0].name == "c at gpt2's shape: a step of its first 3 blocks ÷ a step"
    assert facts[2].name.startswith("on gpt2's shape, a pass over 5") and "low end, 0.70, not judged" in facts[2].name
    assert facts[3].name.startswith("ℓ₀")
    assert facts[4].name == "ℓ, the pair's prompt lookup at γ = 4: loop work per pass"
    assert facts[6].name == "S at gpt2's shape, prompt lookup at γ = 4" and "≥ 1.5×" in facts[6].why
    assert "α = 0.80 and ḡ = 3.00" in facts[6].why and "1.5" not in facts[7].why
    judged = {**f, "shape": {**f["shape"], "premise_band": [1.2, 2.7]}}   # a low end over 1: a check, no fact
    assert [x.name.split(",")[0] for x in lesson.facts(judged)][2:4] == ["ℓ₀", "ℓ"]


def test_without_trained_weights_the_lesson_trains_a_small_model_on_text_python_ships(monkeypatch):
    """A random init's α says nothing: the pair is a small model trained here (a few steps in this test) on the
    standard library's docstrings, and its first block; the passage is that text, and the lesson says so."""
    class Lesson:
        model, config, device, dtype = context_model(), context_model().config, torch.device("cpu"), torch.float32
    Lesson.model.weights_source = "random-init (seed 0)"
    args = type("Args", (), {"model": "tiny", "draft": "auto"})
    target, draft, passage, why = drafts.speculation_pair(Lesson, args, {"train_steps": 3, "train_length": 16,
                                                                         "passage": 12})
    assert target.config == drafts.SMALL and target.weights_source.startswith("trained here: 3 steps of AdamW")
    assert drafts.is_trained(target) and draft.h[0] is target.h[0] and len(draft.h) == 1
    assert bytes(passage) in drafts.training_text() and len(passage) == 12
    assert "tiny has no trained weights here" in why and "weights_download.py tiny" in why
    Lesson.model.weights_source = "weights/gpt2"   # a checkpoint: speculated with as it is
    target, _, passage, why = drafts.speculation_pair(Lesson, args, {"passage": 12})
    assert target is Lesson.model and len(passage) == 12 and why.startswith("target tiny (weights/gpt2)")


def cost(ratio, pass_ms, matmul_ms):
    ks = list(ratio)
    return {"ratio": dict(ratio), "seconds": {"pass": {k: t / 1e3 for k, t in zip(ks, pass_ms)},
                                              "matmuls": {k: t / 1e3 for k, t in zip(ks, matmul_ms)}}}


def sweep(speedup, predicted, guesses, speedups=(1.3, 1.4, 1.3, 1.35, 1.3)):
    return [{"draft": "prompt lookup", "gamma": 4, "speedup": speedup, "predicted": predicted, "modelled": speedup,
             "guesses_per_pass": guesses, "alpha": 0.8, "c": 0.01, "speedups": list(speedups), "loop": 0.5,
             "loop_alone": 0.3, "tokens_per_pass": 1.7, "formula_tokens_per_pass": 1.8, "leviathan_at_gamma": 3.0,
             "at_shape": 1.6},
            {"draft": "model draft", "gamma": 4, "speedup": 0.9, "predicted": 1.0, "modelled": 0.8,
             "guesses_per_pass": 4.0, "tokens_per_pass": 1.2, "formula_tokens_per_pass": 4.1, "alpha": 0.9, "c": 0.4,
             "speedups": [0.85, 0.95] * 2 + [0.9], "loop": 0.6, "loop_alone": 0.3, "leviathan_at_gamma": 1.1,
             "at_shape": 1.4}]


def test_explain_reads_the_cause_from_the_numbers():
    ratio = {1: 1.0, 2: 1.1, 3: 1.15, 5: 2.0}
    explain = lesson.explain(cost(ratio, [10, 11, 12, 20], [8, 9, 10, 16]), sweep(1.3, 2.6, 1.9))
    assert "on the shape a pass stays under 1.2× a step up to k = 3" in explain[0] and "2.00×" in explain[0]
    assert "80% of that in the matrix products" in explain[0]
    assert "the matrix kernel" in explain[0] and "beats 2.50× there at γ = 4" in explain[0]
    assert "worst fit: model draft at γ = 4, 0.90× against S = 0.80× (+12%) at the pair's own costs (c = 0.400, " \
           "4.00 guesses per pass, ℓ = 0.60, ℓ₀ = 0.30); with each pass priced at one step, 1.00× (-10%), and at γ " \
           "guesses 1.10×; it made 1.20 tokens per pass where the formula fed α = 0.90 expects 4.10: its guesses are " \
           "not accepted independently" in explain[1]
    assert "prompt lookup: best γ = 4, 1.30× (α = 0.80, c = 0.010; 1.70 tokens per pass" in explain[2]
    assert "the formula fed α = 0.80 expects 1.80; speculation pays" in explain[2]   # within FIT: nothing to explain
    assert "speculation pays" in explain[2] and "at the shape's costs S = 1.60×" in explain[2]
    assert "speculation does not pay" in explain[3] and "S = 1.40×" in explain[3] and len(explain) == 4
    rows = sweep(1.0, 1.05, 4.0, (0.9, 1.1, 0.95, 1.05, 1.0))
    rows[0]["modelled"] = 2.0
    other = lesson.explain(cost(ratio, [10, 11, 12, 20], [8, 8, 8, 9]), rows)
    assert "10% of that in the matrix products" in other[0] and "mostly outside them" in other[0]
    assert "prompt lookup at γ = 4, 1.00× against S = 2.00× (-50%)" in other[1]
    assert "may or may not pay" in other[2]


def test_the_cost_rounds_add_up(target, one_thread):
    """Tiny shapes, two rounds: the figures are not the point, their bookkeeping is."""
    ks = [1, 3]
    costs = interleave(drafts.cost_fns(target, drafts.shallow_draft(target, 1), ks, context=20), 2, warmup=0)
    summary = drafts.summarise_costs(costs, ks)
    assert summary["ratio"][1] == summary["matmul_ratio"][1] == 1.0
    assert summary["rounds"][3] == costs.ratio("pass 3", "pass 1") and summary["seconds"]["pass"][3] > 0
    assert summary["seconds"]["matmuls"][3] == costs.median("matmuls 3")
    assert set(summary["c"]) == {"model draft", "prompt lookup"} and all(c > 0 for c in summary["c"].values())
    logits = costs.results("pass 3")[0]
    assert logits.shape == (3, target.config.vocab_size)   # logits at every new token, as a verification needs


@pytest.mark.slow
def test_a_student_copy_stops_at_this_lessons_exercise_before_measuring(tmp_path):
    """With only speculative-accept still a stub, the lesson stops at it with one line (its sampled run comes first)."""
    from test_lessons_in_order import assert_stops_at_a_stub, copy_up_to, run_lesson
    copy, stubbed = copy_up_to(13, tmp_path / "student")
    assert "speculative-accept" in [ex.id for ex in stubbed]
    result = run_lesson(copy, 14, tmp_path / "out")
    assert_stops_at_a_stub(result, stubbed)
    assert "greedy, a" not in result.stdout   # stopped before the sweep's table, not after a minute of measuring


def test_the_draft_is_the_classic_pair_when_its_weights_are_present_else_the_shallow_one(target, monkeypatch):
    loaded = []

    def fake_load(name, device, dtype):
        loaded.append(name)
        m = context_model()
        m.weights_source = f"weights/{name}"
        return m
    monkeypatch.setattr(drafts, "load_model", fake_load)
    monkeypatch.setattr(drafts, "has_weights", lambda name: False)
    draft, why = drafts.choose_draft(target, "gpt2", "auto", "cpu", torch.float32)
    assert not loaded and "first 1 block" in why and "no weights for the classic draft distilgpt2 of gpt2" in why
    assert drafts.choose_draft(target, "tiny", "auto", "cpu", torch.float32)[1].endswith("(tiny has no classic draft)")
    monkeypatch.setattr(drafts, "has_weights", lambda name: name == "distilgpt2")
    draft, why = drafts.choose_draft(target, "gpt2", "auto", "cpu", torch.float32)
    assert loaded == ["distilgpt2"] and why == "distilgpt2 (weights/distilgpt2, the classic pair)"
    draft, why = drafts.choose_draft(target, "gpt2-xl", "shallow", "cpu", torch.float32)
    assert "asked for (--draft shallow)" in why and loaded == ["distilgpt2"]
    draft, why = drafts.choose_draft(target, "gpt2-xl", "some/checkpoint", "cpu", torch.float32)
    assert loaded[-1] == "some/checkpoint" and why == "some/checkpoint (weights/some/checkpoint)"


def test_a_draft_of_another_vocabulary_is_refused_with_the_fix(target, monkeypatch):
    small = drafts.shallow_draft(target, 1)
    small.config = target.config.with_(vocab_size=target.config.vocab_size + 7)
    small.weights_source = "weights/other"
    monkeypatch.setattr(drafts, "load_model", lambda name, device, dtype: small)
    with pytest.raises(SystemExit, match=r"--draft other: its vocabulary has \d+ tokens and the target's \d+.*"
                                         r"--draft shallow"):
        drafts.choose_draft(target, "gpt2", "other", "cpu", torch.float32)
