"""Nothing the graded code starts outlives its exercise: a subreaper, and a kill that freezes a tree first.

A process that forks twice, or calls `os.setsid()`, leaves the process group
and the session the grader made for it, so killing that group misses it. On
Linux a process may declare itself a *child subreaper*
(`prctl(PR_SET_CHILD_SUBREAPER)`): an orphan among its descendants is then
handed to it, not to init. The grader is one, and so is each child, so every
process the graded code starts stays in the tree under the grader, whatever
group or session it moved to:

    grader (subreaper) ── starter ── child of an exercise (subreaper) ── what its code started ...
       └── orphans whose child already ended come back here ("strays")

When an exercise ends, `kill_tree` stops its child and every descendant with
SIGSTOP, walking /proc until no new one appears (a stopped process cannot
fork), then kills them all with SIGKILL. Strays, orphans handed back to the
grader, are killed the same way; honest code leaves none. Linux only: where
prctl is missing (a student's `check` on macOS) the child's session is killed
as before, and `check` is no grade.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

from .users import real_uid, signal_verified

PR_SET_CHILD_SUBREAPER, PR_GET_CHILD_SUBREAPER = 36, 37
CAN_REAP = sys.platform.startswith("linux")


def _prctl(option: int, value) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    result = libc.prctl(option, value, 0, 0, 0)
    if result != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}) failed: {os.strerror(ctypes.get_errno())}")
    return result


def set_subreaper(on: bool) -> bool:
    """Make this process a child subreaper (or stop being one); returns whether it was one before."""
    was = ctypes.c_int(0)
    _prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(was))
    _prctl(PR_SET_CHILD_SUBREAPER, int(on))
    return bool(was.value)


def parents() -> dict[int, int]:
    """pid -> parent pid of every process now alive, from /proc."""
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:          # ended while we looked
            continue
        fields = stat[stat.rindex(b")") + 2:].split()   # after "(comm)": state, ppid, ...
        found[int(name)] = int(fields[1])
    return found


def descendants(pid: int, table: dict[int, int] | None = None) -> set[int]:
    """Every process below `pid`."""
    table = parents() if table is None else table
    children: dict[int, list[int]] = {}
    for child, parent in table.items():
        children.setdefault(parent, []).append(child)
    found, todo = set(), list(children.get(pid, []))
    while todo:
        p = todo.pop()
        if p not in found:
            found.add(p)
            todo += children.get(p, [])
    return found


def _signal(pids, sig: int, uid: int | None) -> None:
    if uid is not None:          # only what the kernel says is that user's (users.py)
        signal_verified(pids, sig, uid)
        return
    for p in pids:
        try:
            os.kill(p, sig)
        except (ProcessLookupError, PermissionError):
            pass


def kill_tree(roots: set[int], ours: set[int] = frozenset(), uid: int | None = None) -> None:
    """SIGSTOP `roots` and everything below them until no new process appears, then SIGKILL them all, and reap
    those that are this process's own children (`ours` are left to whoever waits for them). With `uid`, a process
    that the kernel does not say is that user's is never signalled, whatever tree it is found in."""
    frozen: set[int] = set()
    for _ in range(1000):
        table = parents()
        alive = {p for p in roots if p in table}
        found = alive.union(*(descendants(p, table) for p in alive)) if alive else set()
        new = found - frozen
        if not new:
            break
        _signal(new, signal.SIGSTOP, uid)
        frozen |= new
    _signal(frozen, signal.SIGKILL, uid)
    if uid is not None:
        frozen = {p for p in frozen if real_uid(p) in (uid, None)}
    wait_until_gone(frozen - set(ours))   # a killed process whose parent died too is handed to us: reaped here


def strays(known: set[int]) -> set[int]:
    """This process's children that are not in `known`: orphans of the graded code, handed back to the grader."""
    me = os.getpid()
    return {p for p, parent in parents().items() if parent == me and p not in known}


def wait_until_gone(pids: set[int], timeout: float = 10.0) -> set[int]:
    """The processes of `pids` still alive (not even a zombie) after up to `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        alive = pids & set(parents())
        if not alive or time.monotonic() > deadline:
            return alive
        for p in alive:
            try:
                os.waitpid(p, os.WNOHANG)
            except ChildProcessError:   # not (yet) ours: its own parent reaps it, or hands it to us
                pass
        time.sleep(0.01)
