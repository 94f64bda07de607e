"""The one command: python -m minillm.classroom list | make | check | grade (see README "For instructors")."""
from __future__ import annotations

import argparse
import os
import sys
import textwrap
import time
from pathlib import Path

from .copies import make_copy, untracked_files
from .grading import DEFAULT_TIMEOUT_S, grade_exercises, grade_timeout, warn_fixed_seed
from .manifest import MANIFEST, assigned_exercises, is_student_copy
from .regions import ROOT, ExerciseError, find_exercises, select
from .results import (VISIBILITIES, check_writable, failed_results, gradescope_results, results_problems,
                      write_results)

PROG = "python -m minillm.classroom"
WIDTH = 100   # `list` fits a terminal of this many columns
LOCAL_CHECK = ("graded without --user, the code ran as the grader's own user, who can read the answer keys and the "
               "reference: this is only an instructor's local check of their own code, not a grade of a student's. "
               "Grade a submission on the grading image, as root, with --user nobody (the README's run_autograder).")


def cmd_list(args) -> int:
    exercises = find_exercises(ROOT)
    try:
        assigned = {ex.id for ex in assigned_exercises(ROOT)} if (ROOT / MANIFEST).exists() else None
    except ExerciseError:
        assigned = None
    rows = [(ex.id, ex.lesson, str(ex.points), "stub" if ex.is_stub else "written", f"{ex.file}:{ex.line}", ex.title)
            + ((("yes" if ex.id in assigned else "no"),) if assigned is not None else ()) for ex in exercises]
    _table(("id", "lesson", "pts", "state", "where", "title") + (("graded",) if assigned is not None else ()), rows,
           wrap=5)
    print(f"\n{len(exercises)} exercises, {sum(ex.points for ex in exercises)} points, in lesson order")
    return 0


def cmd_make(args) -> int:
    chosen = make_copy(args.dir, args.only, args.force, keys=args.for_grading)
    print(f"wrote a {'copy for the grading image (it holds the answer keys: never give it to a student)' if args.for_grading else 'student copy'} "
          f"to {Path(args.dir).resolve()}: {len(chosen)} exercises stubbed, {sum(ex.points for ex in chosen)} points")
    for ex in chosen:
        print(f"  {ex.id:28} {ex.where()}")
    untracked = untracked_files(ROOT)
    if untracked:
        print(f"\nnot copied, because git does not track them (git add those that belong to the course): "
              f"{', '.join(untracked[:8])}{' ...' if len(untracked) > 8 else ''}")
    print(f"\nnext: cd {args.dir} && {PROG} list")
    return 0


def cmd_check(args) -> int:
    ex = select(find_exercises(ROOT), [args.id])[0]
    student = is_student_copy(ROOT)   # no answer key here: the visible cases, against the copy's literal answers
    if args.seed is not None and not student:
        warn_fixed_seed(args.seed)
    (score,), seed = grade_exercises([ex], ROOT, ROOT, args.seed, grade_timeout(args.timeout), 1,
                                     _checked_user(args.user), visible_only=student)
    print(f"exercise {ex.id} ({ex.worth}): {ex.title}")
    for held_out in (False, True) if not student else (False,):
        results = score.of(held_out)
        print(f"\n{'held-out checks, drawn with seed ' + str(seed) if held_out else 'visible cases'}: "
              f"{sum(r.passed for r in results)}/{len(results)} pass")
        for r in results:
            print(f"  {'PASS' if r.passed else 'FAIL'}  {r.name}")
            if not r.passed:
                print("        " + r.message.replace("\n", "\n        "))
    if score.ended:
        print(f"\nThe run did not finish normally: {score.ended}.")
    if score.printed.strip() and not all(r.passed for r in score.results):
        print("\nWhat the code printed (the end):\n" + score.printed.strip()[-1500:])
    if student:
        print("\nThe held-out checks run at grading, in your instructor's copy, and they give the points: the same "
              "situations and a few edge situations, with inputs drawn afresh.")
    if all(r.passed for r in score.results):
        if student:
            print(f"all {len(score.results)} visible cases of exercise {ex.id} pass.")
        else:
            print(f"\nall {len(score.results)} cases pass: exercise {ex.id} is done ({score.score:g}/{ex.points} points).")
        return 0
    told = f"The code to write is at {ex.where()}.\nHint: {ex.hint}"
    print(told if student else f"\nscore {score.score:g}/{ex.points}. {told}")
    return 1


def cmd_grade(args) -> int:
    started = time.perf_counter()
    try:
        if args.held_out_visibility not in VISIBILITIES:
            raise ExerciseError(f"--held-out-visibility {args.held_out_visibility!r} is not one of "
                                f"{', '.join(VISIBILITIES)}")
        if args.jobs is not None and args.jobs < 1:
            raise ExerciseError(f"--jobs {args.jobs}: grade at least 1 exercise at a time")
        if args.json:   # at once: a path that cannot be written fails before any grading
            check_writable(args.json)
        if args.seed is not None:
            warn_fixed_seed(args.seed)
        submission = Path(args.submission).resolve() if args.submission else ROOT
        if not submission.is_dir():
            raise ExerciseError(f"submission {submission} is not a folder; give the folder that holds the "
                                f"submitted minillm/")
        user = _checked_user(args.user)
        exercises = select(assigned_exercises(ROOT) if (ROOT / MANIFEST).exists() else find_exercises(ROOT),
                           args.only)
        scores, seed = grade_exercises(exercises, ROOT, submission, args.seed, grade_timeout(args.timeout),
                                       args.jobs, user)
        results = gradescope_results(scores, seed, args.held_out_visibility)
        if not user:
            print(f"note: {LOCAL_CHECK}", file=sys.stderr)
            results["output"] += f" Note: {LOCAL_CHECK}"
        problems = results_problems(results)
        if problems:
            raise RuntimeError(f"the grader built invalid results: {problems}")
    except ExerciseError as e:
        if args.json:   # Gradescope needs a results file whatever went wrong
            write_results(args.json, failed_results(f"grading failed: {e}"))
        raise
    except Exception as e:
        if args.json:
            write_results(args.json, failed_results(f"the grader failed ({type(e).__name__}: {e}); tell your "
                                                    f"instructor"))
        raise
    rows = [(s.exercise.id, s.exercise.lesson, f"{sum(r.passed for r in s.of(False))}/{len(s.of(False))}",
             f"{sum(r.passed for r in s.of(True))}/{len(s.of(True))}", f"{s.score:g}", str(s.exercise.points),
             s.ended[:40]) for s in scores]
    if args.held_out_visibility != "visible":   # what the student's code did in held-out runs stays hidden
        rows = [r[:2] + (r[2], "hidden", "hidden", r[5], "") for r in rows]
    _table(("exercise", "lesson", "visible", "held-out", "score", "of", "run"), rows)
    print(f"\ntotal: {results['output']}\ngraded in {time.perf_counter() - started:.1f} s")
    if args.json:
        write_results(args.json, results)
        print(f"wrote {args.json}")
    return 0


def _checked_user(user: str | None) -> str | None:
    if not user:
        return None
    import pwd
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        raise ExerciseError(f"--user {user}: no such user on this system (Gradescope's images have nobody)") from None
    if entry.pw_uid in (0, os.geteuid()):   # every process of that uid is killed at the end of the grade
        raise ExerciseError(f"--user {user} is uid {entry.pw_uid}, the grader's own or root's: the grader kills every "
                            f"process of that uid, so name a user nothing else runs as (nobody)")
    if os.geteuid() != 0:
        raise ExerciseError(f"--user {user} needs the grader to run as root, to hand the children to that user; "
                            f"Gradescope runs run_autograder as root")
    return user


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]], wrap: int | None = None) -> None:
    """Columns padded to their widest cell; column `wrap` is wrapped at spaces onto lines of its own, so that a
    line fits WIDTH and every word of it is shown (a title is never cut)."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    if wrap is not None:
        room = WIDTH - (sum(widths) - widths[wrap]) - 2 * (len(widths) - 1)
        widths[wrap] = max(min(widths[wrap], room), len(header[wrap]), 20)
        wrapped = []
        for r in rows:
            pieces = textwrap.wrap(r[wrap], widths[wrap], break_long_words=False, break_on_hyphens=False) or [""]
            wrapped.append(r[:wrap] + (pieces[0],) + r[wrap + 1:])
            wrapped += [tuple("" for _ in r[:wrap]) + (piece,) + tuple("" for _ in r[wrap + 1:]) for piece in pieces[1:]]
        rows = wrapped
    for r in [header, tuple("-" * w for w in widths), *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description="Classroom exercises: list them, make a student copy, "
                                                             "check one, grade a submission.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the exercises of this project, in lesson order").set_defaults(run=cmd_list)
    p = sub.add_parser("make", help="write a student copy with exercises replaced by stubs")
    p.add_argument("dir", help="where to write the copy: a new or empty folder outside the project")
    p.add_argument("--only", help="comma-separated exercise ids to stub (default: all)")
    p.add_argument("--force", action="store_true", help="replace a previous copy in DIR (the files its manifest lists)")
    p.add_argument("--for-grading", action="store_true", help="a copy for the grading image (Gradescope's source): "
                   "it also holds the answer keys, tests/exercises/key_*.py, so never give it to a student")
    p.set_defaults(run=cmd_make)
    for name, text in (("check", "one exercise: its visible cases and, where the answer keys are (not in a student "
                                 "copy), a fresh draw of held-out checks"),
                       ("grade", "a submission's regions, spliced into this tree; Gradescope's results.json")):
        p = sub.add_parser(name, help=text)
        if name == "check":
            p.add_argument("id")
        else:
            p.add_argument("submission", nargs="?", help="the folder holding the submitted minillm/ (default: this "
                                                         "tree); only the code between its markers is used")
            p.add_argument("--json", help="where to write the results file, e.g. /autograder/results/results.json")
            p.add_argument("--only", help="comma-separated exercise ids to grade (default: what the manifest assigns)")
            p.add_argument("--jobs", type=int, default=None, help="exercises graded at once (default: the cores "
                                                                   "this process may use)")
            p.add_argument("--held-out-visibility", default="visible",
                           help=f"Gradescope visibility of the held-out checks: {', '.join(VISIBILITIES)}")
        p.add_argument("--seed", type=int, default=None, help="seed of the held-out inputs, to reproduce one grade "
                                                               "(default: MINILLM_GRADE_SEED, else a fresh one)")
        p.add_argument("--timeout", type=float, default=None, help=f"seconds each exercise may run (default: "
                       f"MINILLM_GRADE_TIMEOUT, else {DEFAULT_TIMEOUT_S})")
        p.add_argument("--user", help="run the student's code as this unprivileged user (needs root), e.g. nobody")
        p.set_defaults(run=cmd_check if name == "check" else cmd_grade)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except ExerciseError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
