"""Lesson 08 (the cost of paging): its quick run judges the stated point, and its two caches agree."""
import torch

from minillm import PRESETS
from minillm import paged_attention as paging_attention
from minillm.checkpoints.load import random_model

from lessons_support import load_lesson, run_quick  # also puts lessons/ on sys.path

paging = load_lesson("08_paging_cost")


def test_06_quick_judges_the_step_at_the_stated_point(tmp_path, one_thread, capsys):
    doc = run_quick(paging, tmp_path, capsys)
    f, v = doc["figures"], doc["verdict"]
    assert f["judged_context"] == PRESETS["tiny"].n_ctx // 4
    assert {r["block_size"] for r in f["by_block_size"]} == {4, 16, 64}
    for r in f["by_context"] + f["by_block_size"]:
        assert len(r["step_ratio"]) >= 3 and r["gather_s"] > 0 and all(x > 0 for x in r["attention_ratio"])
    assert v["checks"][0]["line"] == paging.STEP_COST_LIMIT and v["checks"][0]["timed"]


def test_06_paged_and_contiguous_steps_compute_the_same_logits():
    """The two caches hold the same (zero) context, so one decode step must give the same logits."""
    model = random_model(PRESETS["tiny"], "cpu", torch.float32)
    contiguous, paged = paging.Decode(model, 3, 20), paging.Decode(model, 3, 20, block_size=4)
    paged.ids = contiguous.ids.view(1, 3)
    torch.testing.assert_close(paged.step(), contiguous.step().view(3, -1), atol=1e-5, rtol=1e-5)
    assert len(paged.blocks.block_tables[0]) == 6 and paged.blocks.block_tables[0][1] == 3  # interleaved blocks


def test_06_times_the_gather_attention_makes_into_the_buffer_it_makes_it_in(monkeypatch):
    """The lesson's "gather" is the copy the engine's attention makes: the same groups of rows, into the same
    kept scratch buffer (a fresh buffer a call costs more on a CPU: paged_attention.py)."""
    model = random_model(PRESETS["tiny"], "cpu", torch.float32)
    paged = paging.Decode(model, 3, 20, block_size=4)
    paged.cache.gather_bytes = 2 * 24 * paged.cache.bytes_per_key  # two rows of 6 blocks of 4 a group
    calls = {"lesson": [], "attention": []}
    real = paging.gather_kv
    for who, module in (("lesson", paging), ("attention", paging_attention)):
        monkeypatch.setattr(module, "gather_kv", lambda pool, tables, n, out=None, who=who: calls[who].append(
            (tables.shape[0], None if out is None else out.data_ptr())) or real(pool, tables, n, out))
    paged.gather()
    paged.step()
    scratch = paged.cache.scratch.data_ptr()
    assert calls["lesson"] == calls["attention"] == [(2, scratch), (1, scratch)] * PRESETS["tiny"].n_layer
