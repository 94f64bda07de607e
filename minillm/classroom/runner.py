"""Running the children: a fresh interpreter per exercise, as the unprivileged user, each with a time limit.

One fresh interpreter, the starter (child.py), runs as that user, imports
torch once and forks a child per exercise: fresh for the grader's secrets,
cheap to start. The grader writes each child's job (its caller's source and
the inputs, as plain data) to a file only the grader can open and hands it
over, open, with the file for what the code prints and the pipe back. When a
run ends, the child and everything it started are killed, wherever they moved
(reaper.py). With `--user`, what the starter says is a claim the kernel must
confirm, and before the grader returns every process of that uid is killed
(users.py).
"""
from __future__ import annotations

import dataclasses
import json
import os
import select
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import reaper, users
from .access import user_ids
from .wire import parse_messages

MAX_OUTPUT = 64 << 20


@dataclasses.dataclass
class ChildRun:
    messages: list[dict]   # what the child sent, in order
    stray: int             # lines that were not messages at all
    ended: str             # "" when it finished; otherwise what happened, in words
    printed: str           # the tail of what the code printed


def signal_name(number: int) -> str:
    """SIGSEGV, or 'signal 40' for a number that has no name."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


class Starter:
    """The fresh interpreter (child.py) that forks one child per exercise, as `user`; the grader's handle on it.

    What it sends is a claim: with `user`, a child's pid counts only once the kernel says it is a process of that
    user and a child of this starter, and the grader then holds a pidfd of it; whether the starter is alive and not
    stopped is read from /proc, not from what it says."""

    def __init__(self, folder: Path, user: str | None, home: Path, limits: dict[str, int]):
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.log = tempfile.TemporaryFile()
        self.ids = user_ids(user) if user else None
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "TMPDIR": str(home),
               "OMP_NUM_THREADS": "1", "LANG": "C.UTF-8"}
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-X", "utf8", str(folder / "minillm" / "classroom" / "child.py"),
                 str(theirs.fileno()), json.dumps(limits)], stdin=subprocess.DEVNULL, stdout=self.log,
                stderr=self.log, pass_fds=(theirs.fileno(),), cwd=folder, env=env, start_new_session=True,
                **({"user": self.ids[0], "group": self.ids[1], "extra_groups": []} if self.ids else {}))
        finally:
            theirs.close()
        self.ended: dict[int, int] = {}   # pid -> exit code, as the starter reported it (a claim: only words)
        self.alive = True
        self.known: set[int] = set()      # the grader's own children: the starter, and what it had before

    def start(self, ex_id: str, job: dict, folder: Path, timeout: float) -> "Child":
        out = tempfile.TemporaryFile()
        with tempfile.TemporaryFile() as stdin:   # only the grader can open it; the child gets it open
            stdin.write(json.dumps({**job, "root": str(folder)}, allow_nan=True).encode())
            stdin.seek(0)
            read, write = os.pipe()
            try:
                socket.send_fds(self.sock, [json.dumps({"exercise": ex_id}).encode()],
                                [stdin.fileno(), out.fileno(), write])
                pid, pidfd = self._wait_started(ex_id)
            except OSError:
                pid, pidfd = None, None
            finally:
                os.close(write)
        return Child(ex_id, pid, pidfd, job, read, out, timeout, self)

    def healthy(self) -> bool:
        """The starter is alive and not stopped, as /proc says (a run of the same user can stop it)."""
        if self.proc.poll() is not None:
            return False
        if not reaper.CAN_REAP:
            return True
        try:
            with open(f"/proc/{self.proc.pid}/stat", "rb") as f:
                data = f.read()
        except OSError:
            return False
        return data[data.rindex(b")") + 2:][:1] not in (b"T", b"t", b"Z", b"X")

    def _wait_started(self, ex_id: str) -> tuple[int | None, int | None]:
        deadline = time.monotonic() + 120   # the starter imports torch first: seconds on a busy machine
        self.sock.settimeout(0.05)
        try:
            while self.alive and time.monotonic() < deadline:
                try:
                    data = self.sock.recv(4096)
                except socket.timeout:
                    self.alive = self.healthy()
                    continue
                if not data:
                    self.alive = False
                    break
                message = self._note(data)
                if message.get("started") == ex_id and type(message.get("pid")) is int:
                    if not self.ids:                  # the grader's own user: nothing to defend
                        return message["pid"], None
                    pidfd = users.held(message["pid"], self.ids[0], parent=self.proc.pid)
                    if pidfd is not None:             # otherwise a forgery: the real report follows
                        return message["pid"], pidfd
        except OSError:
            self.alive = False
        finally:
            self.sock.settimeout(None)
        self.alive = self.alive and self.healthy()
        return None, None

    def _note(self, data: bytes) -> dict:
        """One report of the starter, decoded; an end ("ended") is noted. Anything else is an empty dict."""
        try:
            message = json.loads(data)
        except (ValueError, RecursionError):
            return {}
        if not isinstance(message, dict):
            return {}
        if type(message.get("ended")) is int and type(message.get("code")) is int:
            self.ended[message["ended"]] = message["code"]
        return message

    def poll(self) -> None:
        """Collect the starter's reports of children that ended."""
        self.sock.setblocking(False)
        try:
            while True:
                data = self.sock.recv(4096)
                if not data:
                    self.alive = False
                    return
                self._note(data)
        except BlockingIOError:
            pass
        except OSError:
            self.alive = False
        finally:
            self.sock.setblocking(True)

    def close(self) -> None:
        """Kill the starter: the grader's own child, whose pid the kernel gave it (Popen), not yet reaped."""
        self.sock.close()
        self.proc.kill()
        self.proc.wait()
        self.log.close()


class Child:
    """One exercise's run, forked by the starter in a session of its own."""

    def __init__(self, ex_id, pid, pidfd, job, fd, out, timeout, starter: Starter):
        self.ex_id, self.pid, self.pidfd, self.job, self.fd, self.out = ex_id, pid, pidfd, job, fd, out
        self.num_cases, self.timeout, self.starter = len(job["cases"]), timeout, starter
        os.set_blocking(fd, False)
        self.deadline = time.monotonic() + timeout
        self.buffer = bytearray()

    def read(self) -> None:
        while len(self.buffer) <= MAX_OUTPUT:
            try:
                chunk = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return
            if not chunk:
                return
            self.buffer += chunk

    def exited(self) -> bool:
        """With a pidfd, the kernel's word (it reads as ready once the process ended); else the starter's."""
        if self.pidfd is not None:
            return bool(select.select([self.pidfd], [], [], 0)[0])
        return self.pid is None or self.pid in self.starter.ended or not self.starter.alive

    def finish(self) -> ChildRun:
        """Stop it if it still runs, kill what it left behind, and read everything it sent."""
        timed_out = not self.exited()
        too_much = len(self.buffer) > MAX_OUTPUT
        self.kill()
        for _ in range(100):               # the starter reports the end of a killed child at once
            if self.pid in self.starter.ended or not self.starter.alive:
                break
            time.sleep(0.01)
            self.starter.poll()
        if self.pidfd is not None:
            os.close(self.pidfd)
        code = self.starter.ended.get(self.pid)
        self.read()
        os.close(self.fd)
        messages, stray = parse_messages(bytes(self.buffer[:MAX_OUTPUT]))
        started = [m["start"] for m in messages if "start" in m]
        answered = {m["case"] for m in messages if isinstance(m.get("case"), int)}
        ended = ""
        if self.pid is None:
            ended = "its run could not be started: the process that starts the runs was gone (stopped by code of this submission?)"
        elif too_much:
            ended = "it sent over 64 MB of output and was stopped"
        elif timed_out:
            ended = (f"it ran past the time limit of {self.timeout:g} s and was stopped: an endless loop? (a loop "
                     f"that catches BaseException cannot escape this limit)")
        elif len(answered) < self.num_cases:
            if code is None:
                ended = "the process ended before returning its results, and how is not known"
            elif code < 0:
                ended = f"the process was killed by {signal_name(-code)}: a crash"
            else:
                ended = (f"the process exited with status {code} before returning its results: os._exit() was "
                         f"called, or the interpreter crashed")
        if ended and started:
            ended += f" (during case {str(started[-1])[:200]})"
        self.out.seek(0, os.SEEK_END)
        self.out.seek(max(0, self.out.tell() - 3000))
        printed = self.out.read().decode("utf-8", errors="replace")
        self.out.close()
        return ChildRun(messages, stray, ended, printed)

    def kill(self) -> None:
        """Kill the child and everything it started, wherever that moved, and any orphan handed back to the
        grader (reaper.py); with `user`, only what the kernel says is that user's is signalled. Without a
        subreaper (not Linux), its session's process group and the child."""
        uid = self.starter.ids[0] if self.starter.ids else None
        if reaper.CAN_REAP:
            roots = ({self.pid} if self.pid is not None else set()) | reaper.strays(self.starter.known)
            reaper.kill_tree(roots, ours=self.starter.known, uid=uid)
            return
        for kill in (os.killpg, os.kill):
            try:
                kill(self.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError, TypeError):
                pass


def run_children(jobs: list[tuple[str, dict]], folder: Path, timeout: float, parallel: int,
                 user: str | None, home: Path) -> dict[str, ChildRun]:
    """Run each exercise's job in a child of its own, `parallel` at a time; what each sent, by exercise id.

    A run can stop or kill the starter (it is the same user): then no new run starts until those under way
    end, every process of the user is killed, and a fresh starter runs the rest one at a time, an exercise
    whose start it cost tried once more. With `user`, every process of that uid is killed at the end, until
    /proc shows none (users.py)."""
    pending, running, done, tries = list(jobs), [], {}, {ex_id: 0 for ex_id, _ in jobs}
    if not jobs:
        return done
    ids = user_ids(user) if user else None
    limits = users.rlimits(timeout) if user else {}
    was_subreaper = reaper.set_subreaper(True) if reaper.CAN_REAP else False
    before = reaper.strays(set()) if reaper.CAN_REAP else set()
    starter = Starter(folder, user, home, limits)
    starter.known = before | {starter.proc.pid}
    selector = selectors.PollSelector()
    try:
        while pending or running:
            while pending and len(running) < parallel and starter.alive:
                ex_id, job = pending.pop(0)
                tries[ex_id] += 1
                child = starter.start(ex_id, job, folder, timeout)
                if child.pid is None and not starter.alive and tries[ex_id] < 2:
                    pending.insert(0, (ex_id, job))   # not its fault: the starter was stopped or gone
                    child.finish()
                    continue
                running.append(child)
                selector.register(child.fd, selectors.EVENT_READ, child)
            for key, _ in selector.select(timeout=0.02):
                key.data.read()
            starter.poll()
            now = time.monotonic()
            for child in list(running):
                if child.exited() or now > child.deadline or len(child.buffer) > MAX_OUTPUT:
                    selector.unregister(child.fd)
                    running.remove(child)
                    done[child.ex_id] = child.finish()
            if pending and not running and not starter.alive:
                starter.close()
                if ids:
                    users.kill_all(*ids)
                starter, parallel = Starter(folder, user, home, limits), 1
                starter.known = before | {starter.proc.pid}
    finally:
        for child in running:
            child.kill()
        starter.close()
        if ids:                  # every process of the uid, whatever it claimed or where it moved
            users.kill_all(*ids)
        if reaper.CAN_REAP:      # what the starter's end handed back; then nothing of the graded code is left
            left = reaper.strays(before)
            reaper.kill_tree(left, ours=before, uid=ids[0] if ids else None)
            alive = reaper.wait_until_gone(left)
            reaper.set_subreaper(was_subreaper)
            if alive:
                raise RuntimeError(f"processes of the graded code outlived its kill: {sorted(alive)}")
    return done

