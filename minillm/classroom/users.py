"""The student's uid, as the kernel knows it: who its processes are, how all of them die, and what they leave.

The grader believes only the kernel. A pid that a run sends could name any
process, so root signals none: it learns a run's processes from /proc (the
real uid in /proc/<pid>/status, its parent) and holds a pidfd while it checks
them, so a pid that ended and was reused is never signalled. To end every
process of the uid, a helper drops to that uid and calls kill(-1, SIGKILL)
until none is left: the kernel then lets it reach that uid's processes and
no other, whatever pid a run claimed, whatever group, session or parent it
moved to (`clone(CLONE_PARENT)` included). What the uid leaves in the folders
every user may write (/tmp, /var/tmp, /dev/shm) and its System V IPC objects
are removed after the grade. The uid must be used by nothing else on the
machine: the grader refuses to start while it has a process.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import signal
import stat
import tempfile
import time
from pathlib import Path

SHARED_FOLDERS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/dev/mqueue")   # where any user may leave a file
IPC = (("shm", "shmctl"), ("msg", "msgctl"), ("sem", "semctl"))   # /proc/sysvipc/<kind>, the call that removes one
IPC_RMID = 0
PR_SET_DUMPABLE = 4


def rlimits(timeout: float) -> dict[str, int]:
    """The limits of every run (soft = hard, so a run cannot raise them), far above what an honest run needs:
    8 GiB of address space, 1024 processes of the user, 256 MiB per file written, and CPU seconds of twice the
    time limit and at least 600."""
    return {"RLIMIT_AS": 8 << 30, "RLIMIT_NPROC": 1024, "RLIMIT_FSIZE": 256 << 20,
            "RLIMIT_CPU": int(max(600, 2 * timeout))}


def real_uid(pid: int) -> int | None:
    """The real uid of `pid` from /proc/<pid>/status, None when it has ended."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def processes_of(uid: int) -> set[int]:
    """Every live process whose real uid is `uid` (a zombie still counts: it ends when its parent reaps it)."""
    return {int(n) for n in os.listdir("/proc") if n.isdigit() and real_uid(int(n)) == uid}


def held(pid: int, uid: int, parent: int | None = None) -> int | None:
    """A pidfd of `pid` when the kernel says it is a process of `uid` (and a child of `parent`); else None.
    The pidfd names that one process: signalled through it, a pid reused in the meantime is never hit."""
    try:
        fd = os.pidfd_open(pid)
    except (OSError, ValueError, OverflowError):
        return None
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        ok = int(fields["Uid"].split()[0]) == uid and (parent is None or int(fields["PPid"]) == parent)
        signal.pidfd_send_signal(fd, 0)     # still the process whose status was read
    except (OSError, KeyError, ValueError):
        ok = False
    if not ok:
        os.close(fd)
        return None
    return fd


def signal_verified(pids, sig: int, uid: int) -> None:
    """Send `sig` to each of `pids` that the kernel says is a process of `uid`; never to anything else."""
    for pid in pids:
        fd = held(pid, uid)
        if fd is None:
            continue
        try:
            signal.pidfd_send_signal(fd, sig)
        except OSError:
            pass
        finally:
            os.close(fd)


def kill_all(uid: int, gid: int, timeout: float = 30.0) -> None:
    """Kill every process of `uid`, as `uid`, until /proc shows none; reap those handed to this process."""
    deadline = time.monotonic() + timeout
    while True:
        _kill_as(uid, gid)
        reap()
        left = {p for p in processes_of(uid) if not _zombie(p)}
        if not left:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes of uid {uid} outlived every kill: {sorted(left)[:10]}")
        time.sleep(0.01)


def _kill_as(uid: int, gid: int) -> None:
    """A forked helper drops to `uid` and calls kill(-1, SIGKILL) until no process is left to signal (a zombie
    still counts: the grader reaps, then asks again). It never execs: a process whose uid changed is not dumpable,
    so no process of `uid` may stop it with ptrace (one may kill it: the grader then starts another)."""
    libc = ctypes.CDLL(None, use_errno=True)
    pid = os.fork()
    if pid == 0:
        try:
            libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
            libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
            for _ in range(200):
                os.kill(-1, signal.SIGKILL)
        except BaseException:
            pass
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def reap() -> None:
    """Reap this process's children that ended (orphans of the graded code handed to this subreaper)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if not pid:
            return


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        return data[data.rindex(b")") + 2:][:1] in (b"Z", b"X")
    except (OSError, ValueError):
        return True


def refuse_if_busy(user: str, uid: int) -> None:
    from .regions import ExerciseError
    busy = processes_of(uid)
    if busy:
        raise ExerciseError(f"--user {user} (uid {uid}) already has {len(busy)} process(es) (pids "
                            f"{', '.join(map(str, sorted(busy)[:5]))}): the grader kills every process of that uid, "
                            f"so it must be a user nothing else runs as; end them, or create one for grading "
                            f"(useradd --system --user-group minillm-student) and pass it to --user")


def private_folder(uid: int, gid: int, prefix: str) -> Path:
    """A fresh folder under the system's temporary folder that `uid` alone (and root) may enter."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    os.chown(folder, uid, gid)
    folder.chmod(0o700)
    return folder


def remove_leftovers(uid: int) -> list[str]:
    """Remove what `uid` owns in the shared folders and its System V IPC objects; what was removed, in words.
    Call it once no process of `uid` is left: nothing then moves under the walk."""
    removed = []
    for top in SHARED_FOLDERS:
        removed += _remove_owned(top, uid)
    libc = ctypes.CDLL(None, use_errno=True)
    for kind, call in IPC:
        try:
            rows = Path(f"/proc/sysvipc/{kind}").read_text().splitlines()[1:]
        except OSError:
            continue
        column = {"shm": 7, "msg": 7, "sem": 4}[kind]   # the uid column of each table
        for row in rows:
            fields = row.split()
            if len(fields) > column and int(fields[column]) == uid:
                ident = int(fields[1])
                if kind == "sem":
                    libc.semctl(ident, 0, IPC_RMID)
                else:
                    getattr(libc, call)(ident, IPC_RMID, None)
                removed.append(f"System V {kind} {ident}")
    return removed


def _remove_owned(top: str, uid: int) -> list[str]:
    """Remove every entry owned by `uid` anywhere under `top` (a folder of mode 777 deep in another is as
    writable as `top`), never following a link; a folder of `uid` goes whole."""
    removed, todo = [], [top]
    while todo:
        folder = todo.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if st.st_uid == uid:
                if stat.S_ISDIR(st.st_mode):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    try:
                        os.unlink(entry.path)
                    except OSError:
                        continue
                removed.append(entry.path)
            elif stat.S_ISDIR(st.st_mode):
                todo.append(entry.path)
    return removed
