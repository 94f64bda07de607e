"""Run every lesson in order, quick or full: `python lessons/run_all.py [--quick] [--model gpt2] ...`.

Lessons are found by their file names, `lessons/NN_name.py`, so a new lesson
joins the course by being saved there. Each runs in its own process (a fresh
allocator and fresh ceilings, as a student would run it) with the flags given
here; the summary lists each lesson's time and whether its verdict held.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

LESSONS_DIR = Path(__file__).resolve().parent
DEFAULT_OUT = LESSONS_DIR / "results"


def discover(lessons_dir: Path = LESSONS_DIR) -> list[Path]:
    """Every `NN_name.py` lesson, in course order."""
    return sorted(lessons_dir.glob("[0-9][0-9]_*.py"))


def lesson_command(path: Path, flags: list[str]) -> list[str]:
    return [sys.executable, str(path), *flags]


def verdict_of(out: Path, lesson: Path) -> str:
    """'holds', 'not supported' or '?' from the lesson's results file."""
    try:
        holds = json.loads((out / f"{lesson.stem}.json").read_text())["verdict"]["holds"]
    except (OSError, KeyError, ValueError):
        return "?"
    return "holds" if holds else "not supported"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: seconds per lesson on a CPU")
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    parser.add_argument("--only", default=None, help="comma-separated lesson numbers, e.g. 01,03")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args(argv)

    lessons = discover()
    if args.only:
        wanted = {n.strip().zfill(2) for n in args.only.split(",")}
        lessons = [p for p in lessons if p.name[:2] in wanted]
        if not lessons:
            raise SystemExit(f"--only {args.only} matches no lesson; the lessons are "
                             + ", ".join(p.name[:2] for p in discover()))
    flags = ["--model", args.model, "--device", args.device, "--dtype", args.dtype, "--out", args.out]
    flags += ["--quick"] if args.quick else []

    summary = []
    for path in lessons:
        cmd = lesson_command(path, flags)
        print("$ " + " ".join(cmd), flush=True)
        if args.dry_run:
            continue
        t0 = time.perf_counter()
        rc = subprocess.run(cmd).returncode
        summary.append((path.stem, rc, time.perf_counter() - t0, verdict_of(Path(args.out), path) if rc == 0 else "-"))
    if args.dry_run:
        return 0
    print("\nlesson                           rc   seconds   verdict")
    for name, rc, secs, verdict in summary:
        print(f"{name:<32} {rc:>2} {secs:>9.1f}   {verdict}")
    return 1 if any(rc for _, rc, _, _ in summary) else 0


if __name__ == "__main__":
    sys.exit(main())
