"""Run every lesson in order, quick or full: `python lessons/run_all.py [--quick] [--model gpt2] ...`.

Lessons are found by their file names, `lessons/NN_name.py`, so a new lesson
joins the course by being saved there. Each runs in its own process (a fresh
allocator and fresh ceilings, as a student would run it) with the flags given
here. The summary lists each lesson's wall time and its verdict (HOLDS, NOT
SUPPORTED or INCONCLUSIVE, from its results file), and `<out>/run_all.json`
keeps them with the machine's load over the whole run, so the syllabus's times
can be measured again with one command.

`--runs N` runs the course N times back to back and counts flips: a lesson, or
one of its checks, that came out HOLDS in one run and NOT SUPPORTED in another
(INCONCLUSIVE is no flip: it is the verdict a run that cannot tell must give).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

LESSONS_DIR = Path(__file__).resolve().parent
DEFAULT_OUT = LESSONS_DIR / "results"
STUB_EXIT = 3  # common.STUB_EXIT: the lesson stopped at an exercise still to be written
WEIGHTS_NOTE = "MINILLM_LESSONS_WEIGHTS_NOTE_SHOWN"


def discover(lessons_dir: Path = LESSONS_DIR) -> list[Path]:
    """Every `NN_name.py` lesson, in course order."""
    return sorted(lessons_dir.glob("[0-9][0-9]_*.py"))


def lesson_command(path: Path, flags: list[str]) -> list[str]:
    return [sys.executable, str(path), *flags]


def check_outcomes(out: Path, lesson: Path, rc: int) -> dict[str, str]:
    """Each check's outcome by its key (its name where it has none) from the lesson's results file."""
    try:
        checks = json.loads((out / f"{lesson.stem}.json").read_text())["verdict"]["checks"] if rc == 0 else []
    except (OSError, KeyError, ValueError):
        return {}
    return {c.get("key") or c["name"]: c["outcome"] for c in checks}


def flips(outcomes: list[str]) -> bool:
    """Did a decisive outcome change between runs (HOLDS in one, NOT SUPPORTED in another)?"""
    return {"HOLDS", "NOT SUPPORTED"} <= set(outcomes)


def count_flips(summary: list[dict]) -> dict:
    """Per lesson: whether its verdict flipped across the runs, and which of its checks did."""
    result = {}
    for lesson in dict.fromkeys(row["lesson"] for row in summary):
        rows = [row for row in summary if row["lesson"] == lesson]
        keys = dict.fromkeys(k for row in rows for k in row["checks"])
        result[lesson] = {"verdicts": [row["verdict"] for row in rows], "verdict_flipped": flips([r["verdict"] for r in rows]),
                          "checks_flipped": [k for k in keys if flips([row["checks"].get(k, "") for row in rows])]}
    return result


def verdict_of(out: Path, lesson: Path, rc: int) -> str:
    """The lesson's verdict from its results file, or why there is none."""
    if rc == STUB_EXIT:
        return "stopped: an exercise is still to be written (see its line above)"
    if rc != 0:
        return "failed (see its output above)"
    try:
        return json.loads((out / f"{lesson.stem}.json").read_text())["verdict"]["outcome"]
    except (OSError, KeyError, ValueError):
        return "no results file"


def weights_note(model: str) -> None:
    """Say once, for all lessons, when the model runs on a random init; the lessons then stay quiet about it."""
    sys.path.insert(0, str(LESSONS_DIR.parent))
    from minillm.config import HF_CHECKPOINTS
    from minillm.checkpoints.load import locate
    try:
        folder, preset = locate(model)
    except ValueError:
        return  # the lessons will say what is wrong with the name
    if preset in HF_CHECKPOINTS and not folder.is_dir():
        print(f"No weights in {folder}: every lesson uses a seeded random init of the {preset} shape. Times and "
              f"bytes do not depend on the values; `python weights_download.py {preset}` fetches the real ones.\n")
        os.environ[WEIGHTS_NOTE] = "1"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes: seconds per lesson on a CPU")
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads for every lesson (default: each counts the cores free as it starts)")
    parser.add_argument("--only", default=None, help="comma-separated lesson numbers, e.g. 01,03")
    parser.add_argument("--runs", type=int, default=1, help="run the course this many times back to back and count "
                                                             "the verdicts and checks that flip (default 1)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs {args.runs}: run the course at least once (--runs 5 for the flip count)")

    lessons = discover()
    if args.only:
        wanted = {n.strip().zfill(2) for n in args.only.split(",")}
        lessons = [p for p in lessons if p.name[:2] in wanted]
        if not lessons:
            raise SystemExit(f"--only {args.only} matches no lesson; the lessons are "
                             + ", ".join(p.name[:2] for p in discover()))
    flags = ["--model", args.model, "--device", args.device, "--dtype", args.dtype, "--out", args.out]
    flags += ["--quick"] if args.quick else []
    flags += ["--threads", str(args.threads)] if args.threads else []
    if args.dry_run:
        for path in lessons:
            print("$ " + " ".join(lesson_command(path, flags)))
        return 0

    weights_note(args.model)
    out, summary, started = Path(args.out), [], time.perf_counter()
    try:
        load_before = os.getloadavg()[0]
    except OSError:
        load_before = None
    for run in range(1, args.runs + 1):
        for path in lessons:
            cmd = lesson_command(path, flags)
            print("$ " + " ".join(cmd) + (f"   (run {run} of {args.runs})" if args.runs > 1 else ""), flush=True)
            t0 = time.perf_counter()
            rc = subprocess.run(cmd).returncode
            summary.append({"lesson": path.stem, "run": run, "rc": rc, "wall_s": time.perf_counter() - t0,
                            "verdict": verdict_of(out, path, rc), "checks": check_outcomes(out, path, rc)})
    total = time.perf_counter() - started
    print(f"\n{'lesson':<26} {'seconds':>8}   verdict")
    for row in summary:
        print(f"{row['lesson']:<26} {row['wall_s']:>8.1f}   {row['verdict']}" + (f"   (run {row['run']})" * (args.runs > 1)))
    print(f"{'total':<26} {total:>8.1f}")
    flipped = count_flips(summary)
    if args.runs > 1:
        print(f"flips over {args.runs} runs: {sum(f['verdict_flipped'] for f in flipped.values())} lesson verdicts, "
              f"{sum(len(f['checks_flipped']) for f in flipped.values())} checks"
              + "".join(f"\n  {name}: {', '.join(f['checks_flipped']) or 'no check'} flipped ({' / '.join(f['verdicts'])})"
                        for name, f in flipped.items() if f["verdict_flipped"] or f["checks_flipped"]))
    decisive = sum(row["verdict"] in ("HOLDS", "NOT SUPPORTED") for row in summary)
    print(f"decisive verdicts (HOLDS or NOT SUPPORTED): {decisive} of {len(summary)}")
    out.mkdir(parents=True, exist_ok=True)
    doc = {"command": " ".join(["python", "lessons/run_all.py", *(argv if argv is not None else sys.argv[1:])]),
           "quick": args.quick, "model": args.model, "lessons": summary, "total_s": total, "decisive": decisive,
           "runs": args.runs, "flips": flipped,
           "load_average_before": load_before, "load_average_after": os.getloadavg()[0] if load_before else None,
           "cpu_count": os.cpu_count()}
    (out / "run_all.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(f"results: {out / 'run_all.json'} (each lesson's own load reading is in its results file)")
    return 1 if any(row["rc"] for row in summary) else 0


if __name__ == "__main__":
    sys.exit(main())
