"""The gather bench: both sides of one workload, each in a fresh process, in turns, and their ratio per round."""
import json
import re

from minillm.bench import gather
from minillm.paged_attention import GATHER_BYTES


def test_one_round_serves_both_sides_in_fresh_processes_and_reports_their_ratio(capsys):
    rounds = gather.main(["--model", "tiny", "--num-prompts", "3", "--input-len", "5", "--output-len", "4",
                          "--rounds", "1"])
    out = capsys.readouterr().out
    (sides,) = rounds
    assert set(sides) == {"groups", "one copy"}
    for s in sides.values():
        assert s["tok_s"] > 0 and s["step_s"] > 0 and s["faults"] >= 0 and "thread" in s["threads"]
    ratio = float(re.search(r"in turns\): ([\d.]+) \[", out).group(1))
    assert abs(ratio - sides["groups"]["tok_s"] / sides["one copy"]["tok_s"]) < 0.006


def test_a_side_run_alone_gathers_as_its_bound_says(capsys):
    for bound, expected in ((0, None), (GATHER_BYTES, GATHER_BYTES)):
        gather.main(["--model", "tiny", "--num-prompts", "2", "--input-len", "3", "--output-len", "2",
                     "--gather-bytes", str(bound)])
        assert json.loads(capsys.readouterr().out)["gather_bytes"] == expected  # the engine's own cache, as run
