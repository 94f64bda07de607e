"""Lesson 08 (the cost of paging): its quick run judges the stated point against its cost model, its two caches
agree, the split inside a step times the engine's own gathers, and its check can fail."""
import copy

import torch

from minillm import PRESETS
from minillm import paged_attention as paging_attention
from minillm.bench.verdict import HOLDS, NOT_SUPPORTED
from minillm.checkpoints.load import random_model

from lessons_support import load_lesson, run_quick  # also puts lessons/ on sys.path

paging = load_lesson("08_paging_cost")


def test_08_quick_judges_the_step_at_the_stated_point(tmp_path, one_thread, capsys):
    doc = run_quick(paging, tmp_path, capsys)
    f, v = doc["figures"], doc["verdict"]
    assert f["judged_context"] == PRESETS["tiny"].n_ctx // 4
    assert {r["block_size"] for r in f["by_block_size"]} == {4, 16, 64}
    for r in f["by_context"] + f["by_block_size"]:
        assert len(r["step_ratio"]) >= 5 and all(g > 0 for g in r["parts"]["paged"]["gather_s"])
        assert r["parts"]["contiguous"]["gather_s"] == [0.0] * len(r["step_ratio"])  # nothing to gather
    check = v["checks"][0]
    assert check["predicted"] == f["predicted_step_ratio"] > 1 and check["line"] == f["verdict_line"] and check["timed"]
    w = f["where_the_extra_goes_s"]  # the bars add up to the step: the median round's parts
    assert abs(w["gather"] + w["rest_of_attention"] + w["outside_attention"] - w["step"]) < 1e-9


def test_08_paged_and_contiguous_steps_compute_the_same_logits():
    """The two caches hold the same (zero) context, so one decode step must give the same logits."""
    model = random_model(PRESETS["tiny"], "cpu", torch.float32)
    contiguous, paged = paging.Decode(model, 3, 20), paging.Decode(model, 3, 20, block_size=4)
    paged.ids = contiguous.ids.view(1, 3)
    with torch.inference_mode():
        logits = [model(d.ids, d.cache.prepare(d.segments).positions, cache=d.cache, logits_indices=d.rows)
                  for d in (contiguous, paged)]
    torch.testing.assert_close(logits[1], logits[0].view(3, -1), atol=1e-5, rtol=1e-5)
    assert len(paged.blocks.block_tables[0]) == 6 and paged.blocks.block_tables[0][1] == 3  # interleaved blocks


def test_08_the_split_times_the_gathers_attention_makes_inside_the_step(monkeypatch):
    """The "gather" part is the time of the engine's own `gather_kv` calls inside the step, no other copy."""
    model = random_model(PRESETS["tiny"], "cpu", torch.float32)
    paged = paging.Decode(model, 3, 20, block_size=4)
    paged.cache.gather_bytes = 2 * 24 * paged.cache.bytes_per_key  # two rows of 6 blocks of 4 a group
    calls, real = [], paging_attention.gather_kv
    monkeypatch.setattr(paging_attention, "gather_kv", lambda *a, **k: calls.append(a[1].shape[0]) or real(*a, **k))
    split = paged.step()
    assert calls == [2, 1] * PRESETS["tiny"].n_layer
    assert 0 < split["gather"] < split["attention"]
    assert paging_attention.gather_kv is not real and paged.step()["gather"] > 0  # put back after each step
    assert paging.Decode(model, 3, 20).step()["gather"] == 0.0


def figures(ratios: list[float]) -> dict:
    n = len(ratios)
    part = lambda x: [x] * n  # noqa: E731
    point = {"context": 32, "block_size": 16, "step_ratio": ratios, "gather_bytes": 786_432,
             "parts": {"contiguous": {"step_s": part(1e-3), "gather_s": part(0.0), "attention_s": part(2e-4),
                                      "outside_s": part(8e-4)},
                       "paged": {"step_s": [1e-3 * r for r in ratios], "gather_s": part(1e-4),
                                 "attention_s": part(3e-4), "outside_s": part(9e-4)}}}
    return {"judged_point": point, "predicted_step_ratio": 1.5, "bandwidth": 2e10}


def test_each_check_can_fail():
    assert [c.outcome() for c in paging.checks(figures([1.4, 1.5, 1.45, 1.55, 1.5]))] == [HOLDS]
    slow = figures([3.0, 3.2, 2.9, 3.1, 3.0])  # a gather at a third of the bandwidth: past 1.3× the model
    check, = paging.checks(copy.deepcopy(slow))
    assert check.outcome() == NOT_SUPPORTED and "inside the gather" in check.why


def test_08_a_block_sizes_gather_slower_than_its_padding_explains_is_noted():
    row = lambda bs, nbytes, s: {"block_size": bs, "gather_bytes": nbytes, "gathers_per_layer": 1,  # noqa: E731
                                 "parts": {"paged": {"gather_s": [s] * 5}}}
    assert paging.block_notes([row(16, 1e6, 1e-3), row(64, 1.2e6, 1.2e-3)], 2e10) == []  # its padding, no more
    note, = paging.block_notes([row(16, 1e6, 1e-3), row(64, 1.2e6, 3.6e-3)], 2e10)      # 3× slower per byte
    assert note.startswith("block 64: its gather took 3.6 ms against 1 ms at block 16")
