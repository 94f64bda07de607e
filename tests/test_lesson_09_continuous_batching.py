"""Lesson 09 (continuous batching): its quick run judges every claim from figures that are values of its JSON; the
two modes give the same tokens on a model whose tokens depend on their context; each check can fail."""
import copy

import pytest
import torch

from minillm.bench.batching import finish_steps, long_and_short
from models import context_model

from lessons_support import load_lesson, run_quick  # also puts lessons/ on sys.path

L09 = load_lesson("09_continuous_batching")


def test_quick_run_judges_each_claim_from_the_values_of_its_json(tmp_path, one_thread, capsys):
    doc = run_quick(L09, tmp_path, capsys)
    f, v = doc["figures"], doc["verdict"]
    assert [x["short"] for x in f["spreads"]][0] == [x["long"] for x in f["spreads"]][0]  # the control is uniform
    assert [x["predicted_speedup"] for x in f["spreads"]] == sorted(x["predicted_speedup"] for x in f["spreads"])
    for x in f["spreads"]:  # the engine ran the schedule the cost model counts, in both modes
        assert (x["static_steps"], x["continuous_steps"]) == (x["predicted_static_steps"], x["predicted_continuous_steps"])
        assert len(x["speedup"]) >= 5 and x["requests_differing"] == 0
    assert f["knee"]["predicted_knee"] == f["knee"]["pool_blocks"] // f["knee"]["blocks_per_sequence"]
    # each check of the verdict is rebuilt, value for value, from the figures the JSON holds
    rebuilt = L09.checks(f)
    assert [c.key for c in rebuilt] == [c["key"] for c in v["checks"]]
    assert [c.values for c in rebuilt] == [c["values"] for c in v["checks"]]
    assert [c.line for c in rebuilt] == [c["line"] for c in v["checks"]]
    assert len(rebuilt) == (12 if f["transformers"] else 10)


def test_static_and_continuous_give_the_same_greedy_tokens_on_a_context_model(one_thread):
    model = context_model()
    trace = long_and_short(12, 4, 6, 2, model.config.vocab_size, seed=3)
    runs = {mode: L09.serve(L09.engine(model, mode, 4, 64), trace) for mode in ("continuous", "static")}
    assert runs["continuous"]["tokens"] == runs["static"]["tokens"]
    assert len({tuple(t) for t in runs["static"]["tokens"]}) > 1  # the model's tokens depend on the prompt
    assert [len(t) for t in runs["static"]["tokens"]] == [r.max_tokens for r in trace]
    outs = [r.max_tokens for r in trace]
    for mode, static in (("continuous", False), ("static", True)):
        assert runs[mode]["steps"] == max(finish_steps(outs, 4, static)), mode


def figures() -> dict:
    """Figures on which every check holds: the shape of the lesson's JSON, numbers made up."""
    row = lambda long, short, speedup, pred: {  # noqa: E731
        "long": long, "short": short, "output_tokens": 768, "predicted_speedup": pred, "speedup": [speedup] * 5,
        "static_steps": 300, "continuous_steps": 100, "predicted_short_latency_ratio": 10.0,
        "short_latency_ratio": [8.0] * 5, "requests_differing": 0}
    return {"spreads": [row(12, 12, 1.0, 1.0), row(33, 9, 1.3, 1.5), row(82, 2, 2.2, 3.1)],
            "transformers": {"s": [1.0] * 5, "speedup": [3.0] * 5, "requests_differing": 0},
            "knee": {"max_num_seqs": [1, 2, 4, 8, 16], "predicted_knee": 4, "pool_blocks": 8, "prompt_blocks": 1,
                     "throughput": [[400.0] * 5, [700.0] * 5, [1000.0] * 5, [1020.0] * 5, [1050.0] * 5],
                     "preemptions": [0, 0, 0, 8, 8], "predicted_steps": [256, 128, 64, 32, 16]}}


def test_each_check_can_fail():
    """For each check in turn, figures that put it on the wrong side: that check is NOT SUPPORTED."""
    assert {c.key: c.outcome() for c in L09.checks(figures())} == dict.fromkeys(
        ["speedup", "speedup_over_model", "speedup_transformers", "tokens_transformers", "tokens", "control",
         "growth", "short_latency", "knee_rise", "knee_flat", "knee_no_preemption", "knee_preemption"], "HOLDS")

    def wrong(change):
        f = copy.deepcopy(figures())
        change(f)
        return f
    cases = {
        "speedup": lambda f: f["spreads"][2].update(speedup=[1.2] * 5),
        "speedup_over_model": lambda f: f["spreads"][2].update(predicted_speedup=6.0),
        "speedup_transformers": lambda f: f["transformers"].update(speedup=[1.1] * 5),
        "tokens_transformers": lambda f: f["transformers"].update(requests_differing=2),
        "tokens": lambda f: f["spreads"][2].update(requests_differing=1),
        "control": lambda f: f["spreads"][0].update(speedup=[1.4] * 5),
        "growth": lambda f: f["spreads"][1].update(speedup=[2.1] * 5),
        "short_latency": lambda f: f["spreads"][2].update(short_latency_ratio=[1.1] * 5),
        "knee_rise": lambda f: f["knee"].update(throughput=[[900.0] * 5, *f["knee"]["throughput"][1:]]),
        "knee_flat": lambda f: f["knee"]["throughput"].__setitem__(4, [2000.0] * 5),
        "knee_no_preemption": lambda f: f["knee"].update(preemptions=[0, 0, 3, 8, 8]),
        "knee_preemption": lambda f: f["knee"].update(preemptions=[0, 0, 0, 0, 0]),
    }
    for key, change in cases.items():
        outcomes = {c.key: c.outcome() for c in L09.checks(wrong(change))}
        assert outcomes[key] == "NOT SUPPORTED", (key, outcomes)


def test_without_transformers_the_lesson_judges_the_engines_static_mode_alone():
    f = figures()
    f["transformers"] = None
    assert "speedup_transformers" not in {c.key for c in L09.checks(f)}
    assert all(c.outcome() == "HOLDS" for c in L09.checks(f))


def test_quick_on_a_cpu_keeps_the_models_width_and_one_layer():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert L09.quick_layers("gpt2", True, cpu) == L09.QUICK_CPU_LAYERS == 1
    assert L09.quick_layers("tiny", True, cpu) is None  # the tests' shape is smaller still
    assert L09.quick_layers("gpt2", False, cpu) is None and L09.quick_layers("gpt2", True, cuda) is None


def test_quick_on_a_cpu_serves_the_one_layer_model_it_says(tmp_path, monkeypatch):
    served = []

    def measure(lesson, s, hf):  # main's measurement: the model it was handed, and nothing run
        served.append((lesson.config.n_layer, lesson.config.n_embd, lesson.config.vocab_size))
        raise SystemExit
    monkeypatch.setattr(L09, "measure_spreads", measure)
    monkeypatch.setattr(L09, "quick_layers", lambda model, quick, device: 1 if quick else None)  # tiny stands in
    for argv in (["--quick"], []):
        with pytest.raises(SystemExit):
            L09.main([*argv, "--device", "cpu", "--model", "tiny", "--out", str(tmp_path)])
    assert served[0][0] == 1 and served[1][0] > 1 and served[0][1:] == served[1][1:]
