"""The classroom: exercises cut from the reference engine, student copies, and a grader that only the regions reach.

    python -m minillm.classroom list                       # id, lesson, points, stub/written, where, in lesson order
    python -m minillm.classroom make DIR [--only IDS] [--force] [--for-grading]
    python -m minillm.classroom check ID                   # one exercise: visible cases (+ a held-out draw, not in a copy)
    python -m minillm.classroom grade [SUBMISSION] [--json PATH] [--user nobody]   # as root, on the image

Regions (regions.py). Pieces of the reference engine are marked in place:

    # >>> exercise kv-cache-write (lesson 01, 2 pts): store the new keys and values in their slots
    # hint: <the idea and what to think about, never the steps; may end "Off limits: name, name.">
    <reference code, at the marker's indentation or deeper>
    # <<< exercise

`make` (copies.py) writes a copy: exactly the files git tracks, each chosen
region's code replaced by one `raise NotImplementedError('exercise <id> ...')`
line, and a manifest, exercises.json (manifest.py), after the leak check
(leaks.py) found no run of 8 tokens of a solution in anything the copy holds,
code and prose alike. The answer keys (tests/exercises/key_*.py) and the
catalogue of wrong versions (wrong_*.py) stay with the instructor: instead the
copy holds each visible case's answer as literal data (answers.py), written
only once the reference passed that case. So a student copy's pytest and
`check` run the visible cases alone, and its held-out checks run at grading;
`grade` refuses a student copy. `make --for-grading` writes the copy for the
grading image, which holds the keys as well: never give it to a student.

Grading, and what it defends against
------------------------------------
  * Only the regions count (splice.py). `grade SUBMISSION` reads the code
    between each assigned exercise's markers in the submission and splices
    it into this tree's own files, in a fresh folder. Every other line, the
    package's `__init__` and this grader included, is the instructor's; a
    marker missing or duplicated, or a region that is not whole statements
    staying inside its function, fails that exercise alone, its results
    naming the file, the line and the marker. A region may not use its hint's
    "Off limits" names, nor transformers, the checks, the answer keys or the
    catalogue (test_ex_*, key_*, wrong_*; checked on its syntax tree, names
    given as constant strings to import_module, __import__, getattr included).
  * The answer is out of reach (exposure.py, callers.py, runner.py, child.py).
    Each exercise runs in a fresh interpreter, as `--user`, that receives only
    its inputs as plain data and the source of the check's `run`, cut out of
    the test file with the definitions it uses; `verify`, the oracles and the
    seed stay here, and so do the answers: a copy's visible_answers.json is
    never read in grading, so editing it changes no grade. With `--user` the
    grader refuses to start when that user could read the checks, or a graded
    region's solution in the tree graded from, the installed package's tree or
    the working folder (grade in a `make --for-grading` copy), or could not
    read the interpreter or a folder its packages come from. Without `--user`
    the code runs as the grader's user, and `grade` says it is only an
    instructor's local check of their own code.
  * A child costs only its own exercise (judge.py). Its output is JSON data,
    decoded and judged here inside a guard of its exercise; a crash, a signal
    (named, or by number), os._exit, sys.exit, an endless loop, forged lines
    or inputs changed in place fail that exercise only. When its run ends,
    the child and every process it started are killed, wherever they moved
    (reaper.py: subreapers on Linux).
  * The grader believes only the kernel (users.py). With `--user`, root
    signals only what /proc and a pidfd say is that user's, never a pid a run
    names; at the end a helper dropped to the uid kills all of its processes
    until none is left; runs get a private HOME and TMPDIR and rlimits, and
    what the uid left in /tmp, /var/tmp, /dev/shm and System V IPC is removed.
    The submission's files are read without following links (splice.py).
  * The results file is written once, at the end, when no process of the
    graded code is left: whole (renamed into place) and ASCII, also when
    grading fails, with the reason (results.py).
  * Held-out inputs are drawn from a fresh seed recorded in the results. A
    fixed one (MINILLM_GRADE_SEED, --seed) prints a warning: a table of
    answers built for it would pass, so it is only for reproducing a grade.
  * With held-out results hidden (--held-out-visibility), nothing the code
    printed, and no way its run ended, reaches the visible output.
What no check stops: names computed at run time (the off-limits check reads
names), code that reads other files its user can read (a copy of the
reference left elsewhere on the image), network use, and exhausting memory or
disk up to the rlimits (docs/grading.md).

Adding an exercise
------------------
 1. Mark the region, around whole statements of one function. Its hint asks
    the question the code answers; the leak check fails on 8 consecutive
    tokens of the solution (names and spacing aside) anywhere in a copy.
 2. Write its Check in tests/exercises/test_ex_<concept>.py (see
    exercise_checks.py): deterministic visible cases, held-out situations and
    edges() (fixed situations, values drawn), `run` (calls only the function holding the region, and uses
    no oracle: it is sent to the child), `expect` (imports its oracle from
    tests/exercises/key_<concept>.py inside the method and returns plain data:
    the answer, and the answers of mistakes worth naming) and `judge` (compares
    and names the mistake; works nothing out). No code of a solution in the
    test file: it goes to every copy, the key file to none.
 3. Add at least three plausible wrong versions of the region to the catalogue
    in tests/exercises/wrong_<concept>.py; tests/test_exercise_catalogue.py holds each of
    them below full marks on every one of 200 seeds, and the reference at full.
"""
