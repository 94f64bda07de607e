"""The grade the kernel keeps: what the student's uid can send, write, leave or point at decides nothing root does.

Each test runs the README's run_autograder as written, as root, with `--user nobody`, on the stock-like image of
tests/test_exercise_image.py, one grade after another on the same machine. Every attack sits in its own exercise
of one submission; the other exercises are honest and must score in full.
"""
from __future__ import annotations

import json
import os
import platform
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

from minillm.classroom import users
from minillm.classroom.copies import make_copy
from minillm.classroom.regions import find_exercises

from exercise_tool_support import reference  # noqa: F401  (fixtures)
from exercise_tool_support import reference_only, restore, results_by_exercise, sign_in_folder, world_readable
from test_exercise_image import image, student_copy  # noqa: F401  (the image fixture)

NOBODY = 65534

FORGER = """\
import ctypes as _c, json as _j, os as _os, socket as _s
_libc = _c.CDLL(None, use_errno=True)
_starter = _os.getppid()
_grader = int(open(f"/proc/{{_starter}}/stat").read().rsplit(")", 1)[1].split()[1])
_victims = [{victim}, _grader]
_taken = []
try:
    _pidfd = _os.pidfd_open(_starter)
except OSError:
    _pidfd = -1
for _fd in range(3, 64):            # the starter's socket to the grader, copied with pidfd_getfd
    _got = _libc.syscall(438, _pidfd, _fd, 0)
    if _got < 0:
        continue
    try:
        _sock = _s.socket(fileno=_got)
        for _ex in {ids!r}:
            for _v in _victims:
                _sock.send(_j.dumps({{"started": _ex, "pid": _v}}).encode())
                _sock.send(_j.dumps({{"ended": _v, "code": 0}}).encode())
        _taken.append(_fd)
    except OSError:
        pass
for _v in _victims:                 # and the plain way: nobody may not signal root's processes
    try:
        _os.kill(_v, 19)
    except OSError:
        pass
open({log!r}, "w").write(_j.dumps({{"taken": _taken, "errno": _c.get_errno()}}))
raise NotImplementedError("the forger")
"""

OUTLIVER = """\
import ctypes as _c, os as _os, time as _time
_pid = _c.CDLL(None).syscall({clone}, 0x8000 | 17, 0, 0, 0, 0)   # clone(CLONE_PARENT): a sibling of the run
if _pid == 0:
    for _ in range(600):            # a new pid every 0.1 s, so that no snapshot of pids catches it
        if _os.fork():
            _os._exit(0)
        open(_os.path.join({pids!r}, str(_os.getpid())), "w").close()
        _time.sleep(0.1)
    _os._exit(0)
_time.sleep(0.5)
raise NotImplementedError("the outliver")
"""

LEAVER = """\
import ctypes as _c, json as _j, os as _os, stat as _st
for _folder in ("/tmp", "/var/tmp", "/dev/shm"):
    with open(_os.path.join(_folder, "minillm-left-by-a-run"), "w") as _f:
        _f.write("honest top-p code, for the next student")
    _os.makedirs(_os.path.join(_folder, "minillm-left-folder", "deeper"), exist_ok=True)
_libc = _c.CDLL(None, use_errno=True)
_shm = _libc.shmget(0, 4096, 0o1000 | 0o666)          # IPC_PRIVATE, IPC_CREAT
_msg = _libc.msgget(0, 0o1000 | 0o666)
_home = _os.environ["HOME"]
_info = _os.stat(_home)
open({log!r}, "w").write(_j.dumps({{"shm": _shm, "msg": _msg, "home": _home, "tmpdir": _os.environ["TMPDIR"],
                                   "mode": _st.S_IMODE(_info.st_mode), "owner": _info.st_uid,
                                   "graded": _st.S_IMODE(_os.stat({root}).st_mode)}}))
raise NotImplementedError("the leaver")
"""

STOPPER = ["import os, signal", "os.kill(os.getppid(), signal.SIGSTOP)   # the starter: no later run could start",
           "raise NotImplementedError('the stopper')"]
DOOR = ["return decode_attention(q, k, v, mask)   # attention written out already, for any number of queries"]
HONEST = {"paged-allocate", "paged-free", "paged-slot-mapping", "scheduler-preempt", "scheduler-admit",
          "scheduler-finish", "scheduler-budget-fill", "prefix-match", "speculative-accept", "quantize-per-channel"}


def leftovers() -> list[str]:
    """What nobody owns in the shared folders, and its System V IPC objects."""
    found = []
    for top in users.SHARED_FOLDERS:
        for folder, dirs, files in os.walk(top):
            found += [os.path.join(folder, n) for n in dirs + files
                      if os.lstat(os.path.join(folder, n)).st_uid == NOBODY]
    for kind, column in (("shm", 7), ("msg", 7), ("sem", 4)):
        rows = Path(f"/proc/sysvipc/{kind}").read_text().splitlines()[1:]
        found += [f"{kind} {row.split()[1]}" for row in rows if int(row.split()[column]) == NOBODY]
    return found


@reference_only
def test_what_the_uid_sends_leaves_or_stops_hurts_no_one_and_outlives_nothing(image, reference, tmp_path):
    """A run copies the starter's socket and forges the pids of a root process and of the grader; another makes a
    sibling with clone(CLONE_PARENT) that changes its pid every 0.1 s, to wait for the next grade; another
    leaves files in /tmp, /var/tmp, /dev/shm and System V IPC objects; another SIGSTOPs the
    starter; two regions make the parser raise MemoryError and RecursionError; one calls decode_attention.
    The root process and the grader live, the grade ends in minutes with every honest exercise in full and every
    attack at 0, and when run_autograder returns, nobody has no process, no file and no IPC object left."""
    assert not users.processes_of(NOBODY), "nobody has processes before the grade: the test needs it unused"
    submission = student_copy(image)
    pids = sign_in_folder()
    by_id = {ex.id: ex for ex in find_exercises(submission)}
    victim = subprocess.Popen(["sleep", "600"])           # a root process that has nothing to do with the grade
    clone = {"x86_64": 56, "aarch64": 220}[platform.machine()]
    attacks = {
        "model-heads": FORGER.format(victim=victim.pid, ids=sorted(by_id), log=str(pids / "forger.json")),
        "sampling-top-k": OUTLIVER.format(clone=clone, pids=str(pids)),
        "sampling-top-p": LEAVER.format(log=str(pids / "leaver.json"), root="_os.getcwd()"),
        "paged-gather": "\n".join(STOPPER),
        "kv-cache-write": "x = (" + "\n".join(["-" * 900] * 21) + "1)",    # MemoryError in the parser, within
        "kv-cache-read": "x = (a" + "\n".join([".a" * 450] * 21) + ")",    # the caps; RecursionError building the tree
        "model-causal-attention": "\n".join(DOOR),
    }
    assert set(attacks) | HONEST == set(by_id)
    for ex_id, code in attacks.items():
        restore(submission, by_id[ex_id], code.splitlines())
    for ex_id in HONEST:
        restore(submission, next(r for r in reference if r.id == ex_id))
    world_readable(submission)
    try:
        started = time.monotonic()
        proc = image.run_autograder()
        took = time.monotonic() - started
        print(f"the grade with the attacks took {took:.1f} s")
        assert victim.poll() is None, "the root process was killed on a forged pid"
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert not users.processes_of(NOBODY), f"nobody's processes outlived the grade: {users.processes_of(NOBODY)}"
        assert not leftovers(), f"left behind by the grade: {leftovers()}"
        results = results_by_exercise(image.results())
        said = {ex_id: results[ex_id]["held-out checks"]["output"] for ex_id in attacks}
        assert (pids / "forger.json").exists() and (pids / "leaver.json").exists(), said
        forger = json.loads((pids / "forger.json").read_text())
        leaver = json.loads((pids / "leaver.json").read_text())
        hops = [p.name for p in pids.iterdir() if p.name.isdigit()]
    finally:
        victim.kill()
        victim.wait()
        shutil.rmtree(pids)
    scores = {ex_id: t["held-out checks"]["score"] for ex_id, t in results.items()}
    assert {ex_id: scores[ex_id] for ex_id in HONEST} == {ex_id: by_id[ex_id].points for ex_id in HONEST}, scores
    assert all(scores[ex_id] == 0 for ex_id in attacks), scores
    assert took < 300, f"the grade took {took:.0f} s: a stopped starter held it up"
    outputs = {ex_id: results[ex_id]["held-out checks"]["output"] for ex_id in attacks}
    assert "MemoryError" in outputs["kv-cache-write"] and "RecursionError" in outputs["kv-cache-read"]
    assert "decode_attention" in outputs["model-causal-attention"] and "off limits" in outputs["model-causal-attention"]
    assert forger["taken"] == [], f"a run took the starter's descriptors {forger['taken']}: it must be non-dumpable"
    assert leaver["home"] == leaver["tmpdir"] and leaver["home"] not in ("/tmp", "/root"), leaver
    assert leaver["mode"] == 0o700 and leaver["owner"] == NOBODY and leaver["graded"] == 0o750, leaver
    assert len(hops) > 1, f"the sibling never ran ({hops}): the test shows nothing"


@reference_only
def test_the_submission_is_read_as_what_it_claims_to_be(image, reference, tmp_path):
    """Graded files that are links to a reference kept private (chmod 700), to /dev/zero, to a root-only file
    and to a path that does not exist, a FIFO, and a second name (hard link) of the private reference: each fails
    the exercises of that file alone, at once, saying the same whatever lies outside; the rest score in full."""
    submission = student_copy(image)
    private = image.base / "private-reference"
    make_copy(private, only="paged-free", keys=True)      # every region but paged-free holds the solution
    private.chmod(0o700)
    by_id = {ex.id: ex for ex in find_exercises(submission)}
    for ex in reference:
        restore(submission, ex)
    secret = Path("/root/minillm-kernel-secret")
    secret.write_text("root only\n")
    secret.chmod(0o600)
    places = {"minillm/model.py": private / "minillm" / "model.py", "minillm/kv_cache.py": Path("/dev/zero"),
              "minillm/block_manager.py": Path("/root/minillm-no-such-file"), "minillm/paged_attention.py": secret}
    try:
        for rel, target in places.items():
            (submission / rel).unlink()
            (submission / rel).symlink_to(target)
        (submission / "minillm" / "sampling.py").unlink()
        os.mkfifo(submission / "minillm" / "sampling.py")
        (submission / "minillm" / "speculative.py").unlink()
        os.link(private / "minillm" / "speculative.py", submission / "minillm" / "speculative.py")
        proc = image.run_autograder()
    finally:
        secret.unlink()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = results_by_exercise(image.results())
    odd = {"minillm/model.py", "minillm/kv_cache.py", "minillm/block_manager.py", "minillm/paged_attention.py",
           "minillm/sampling.py", "minillm/speculative.py"}
    for ex_id, ex in by_id.items():
        held = results[ex_id]["held-out checks"]
        want = 0 if ex.file in odd else ex.points
        assert held["score"] == want, f"{ex_id} ({ex.file}) scored {held['score']}, expected {want}: {held['output']}"
    said = {ex.file: results[ex_id]["held-out checks"]["output"] for ex_id, ex in by_id.items() if ex.file in odd}
    for rel in places:
        assert f"the submission's {rel} is a link" in said[rel], said[rel]
    assert "not a plain file" in said["minillm/sampling.py"] and "not a plain file" in said["minillm/speculative.py"]
    linked = {re.search(r"the submission's \S+ is a link[^\n]*", said[rel]).group(0).replace(rel, "FILE")
              for rel in places}
    assert len(linked) == 1, f"the messages differ with what lies outside the submission: {linked}"
    assert "minillm-no-such-file" not in image.results().read_text() and "secret" not in image.results().read_text()


def test_the_kernel_names_a_process_of_the_user_or_none():
    """users.held: a pidfd only for a process the kernel says is the user's (and the given parent's child)."""
    me = os.getpid()
    fd = users.held(me, os.getuid())
    assert fd is not None and signal.pidfd_send_signal(fd, 0) is None
    os.close(fd)
    assert users.held(me, NOBODY) is None, "a root process must never pass for nobody's"
    assert users.held(me, os.getuid(), parent=me) is None, "nor a process for a child of one that is not its parent"
    assert users.held(2**22 + 12345, os.getuid()) is None


KILLER = """\
import os as _os, signal as _signal, time as _time
open("/run/lock/minillm-left-by-a-run", "w").write("for the next student")
if _os.fork() == 0:
    _os.setsid()
    _end = _time.monotonic() + 120
    while _time.monotonic() < _end:  # every other process of its user dies, the grader's helper among them
        try:
            _os.kill(-1, _signal.SIGKILL)
        except OSError:
            pass
    _os._exit(0)
raise NotImplementedError("the killer")
"""


@reference_only
def test_a_run_that_kills_every_process_of_its_user_cannot_outlive_the_grade(image, reference):
    """An adversary who has read users.py: a process that calls kill(-1, SIGKILL) without pause kills the starter,
    the other runs and the grader's own helper as soon as it becomes the user's, and leaves a file in /run/lock.
    The grade still ends with a results file, the killer's exercise at 0, no process of nobody alive and nothing
    of nobody's left in /run/lock; what it cost is its own submission's other exercises."""
    assert not users.processes_of(NOBODY), "nobody has processes before the grade: the test needs it unused"
    submission = student_copy(image)
    by_id = {ex.id: ex for ex in find_exercises(submission)}
    for ex in reference:
        restore(submission, ex)
    restore(submission, by_id["paged-free"], KILLER.splitlines())
    world_readable(submission)
    started = time.monotonic()
    proc = image.run_autograder()
    took = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not users.processes_of(NOBODY), f"nobody's processes outlived the grade: {users.processes_of(NOBODY)}"
    assert not leftovers(), f"left behind by the grade: {leftovers()}"
    assert results_by_exercise(image.results())["paged-free"]["held-out checks"]["score"] == 0
    assert took < 300, f"the grade took {took:.0f} s"
