"""The gather bench: both sides of one workload, each in a fresh process, in turns, and their ratio per round."""
import json
import re

import pytest

from minillm.bench import gather
from minillm.paged_attention import GATHER_BYTES


def test_one_round_serves_both_sides_in_fresh_processes_and_reports_their_ratio(capsys):
    rounds = gather.main(["--model", "tiny", "--num-prompts", "3", "--input-len", "5", "--output-len", "4",
                          "--rounds", "1"])
    out = capsys.readouterr().out
    (sides,) = rounds
    assert sides["groups"]["gather_bytes"] == GATHER_BYTES and sides["one copy"]["gather_bytes"] is None
    for s in sides.values():
        assert s["tok_s"] > 0 and s["step_s"] > 0 and s["faults"] >= 0
        assert "as asked (--threads)" in s["threads"]  # the parent chose once for both
    ratio = float(re.search(r"in turns\): ([\d.]+) \[", out).group(1))
    assert abs(ratio - sides["groups"]["tok_s"] / sides["one copy"]["tok_s"]) < 0.006


def test_a_side_run_alone_gathers_as_its_bound_says(capsys):
    for bound, expected in ((0, None), (GATHER_BYTES, GATHER_BYTES)):
        gather.main(["--model", "tiny", "--num-prompts", "2", "--input-len", "3", "--output-len", "2",
                     "--gather-bytes", str(bound)])
        assert json.loads(capsys.readouterr().out)["gather_bytes"] == expected  # the engine's own cache, as run


def test_a_workload_with_no_full_batch_step_is_refused_with_its_flags():
    with pytest.raises(ValueError, match="no step decoded all 2 requests at once .*raise --output-len"):
        gather.serve_once("tiny", 2, 3, 1, None, 1)  # one output token: its prefill step samples it, no decode


@pytest.mark.parametrize("flags", [["--rounds", "0"], ["--gather-bytes", "-1"]])
def test_bad_flags_are_refused(flags, capsys):
    with pytest.raises(SystemExit):
        gather.main(["--model", "tiny", *flags])
    assert "must be at least" in capsys.readouterr().err
