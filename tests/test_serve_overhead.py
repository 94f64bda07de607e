"""What serving costs: the served and offline runs of one workload, in turns, and their ratio per round."""
from minillm.bench import serve_overhead


def test_served_and_offline_runs_of_the_same_workload_give_one_ratio_per_round(capsys):
    ratios = serve_overhead.main(["--model", "tiny", "--num-prompts", "3", "--input-len", "5", "--output-len", "4",
                                  "--rounds", "2", "--max-num-seqs", "4"])
    out = capsys.readouterr().out
    rounds = [line for line in out.splitlines() if line.startswith("round ")]
    assert len(rounds) == 2 and len(ratios) == 2 and all(r > 0 for r in ratios)
    for line, ratio in zip(rounds, ratios):
        served, offline = (float(line.split(side)[1].split()[0]) for side in ("served ", "offline "))
        assert abs(served / offline - ratio) < 0.01 * ratio + 0.05
    assert f"[{min(ratios):.3f}–{max(ratios):.3f}] (aim ≥ 0.9)" in out
