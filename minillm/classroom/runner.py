"""Running the children: a fresh interpreter per exercise, as the unprivileged user, each with a time limit.

One fresh interpreter, the starter (child.py), runs as that user, imports
torch once and forks a child per exercise: fresh for the grader's secrets,
cheap to start. The grader writes each child's job (its caller's source and
the inputs, as plain data) to a file only the grader can open and hands it
over, open, with the file for what the code prints and the pipe back. When a
run ends, the child and everything it started are killed, wherever they moved
(reaper.py), and before the grader returns, no process of the graded code is
left.
"""
from __future__ import annotations

import dataclasses
import json
import os
import selectors
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import reaper
from .access import user_ids

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
    """The fresh interpreter (child.py) that forks one child per exercise, as `user`; the grader's handle on it."""

    def __init__(self, folder: Path, user: str | None):
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.log = tempfile.TemporaryFile()
        ids = user_ids(user) if user else None
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": tempfile.gettempdir(),
               "OMP_NUM_THREADS": "1", "LANG": "C.UTF-8"}
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-X", "utf8", str(folder / "minillm" / "classroom" / "child.py"),
                 str(theirs.fileno())], stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log,
                pass_fds=(theirs.fileno(),), cwd=folder, env=env, start_new_session=True,
                **({"user": ids[0], "group": ids[1], "extra_groups": []} if ids else {}))
        finally:
            theirs.close()
        self.ended: dict[int, int] = {}   # pid -> exit code, as the starter reported it
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
                pid = self._wait_started(ex_id)
            except OSError:
                pid = None
            finally:
                os.close(write)
        return Child(ex_id, pid, len(job["cases"]), read, out, timeout, self)

    def _wait_started(self, ex_id: str):
        self.sock.settimeout(120)          # the starter imports torch first: seconds on a busy machine
        try:
            while True:
                data = self.sock.recv(4096)
                if not data:
                    self.alive = False
                    return None
                message = json.loads(data)
                if "ended" in message:
                    self.ended[message["ended"]] = message["code"]
                elif message.get("started") == ex_id:
                    return message["pid"]
        except (OSError, ValueError):
            self.alive = False
            return None
        finally:
            self.sock.settimeout(None)

    def poll(self) -> None:
        """Collect the starter's reports of children that ended."""
        self.sock.setblocking(False)
        try:
            while True:
                data = self.sock.recv(4096)
                if not data:
                    self.alive = False
                    return
                message = json.loads(data)
                if "ended" in message:
                    self.ended[message["ended"]] = message["code"]
        except BlockingIOError:
            pass
        except (OSError, ValueError):
            self.alive = False
        finally:
            self.sock.setblocking(True)

    def close(self) -> None:
        self.sock.close()
        for kill in (os.killpg, os.kill):
            try:
                kill(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.proc.wait()
        self.log.close()


class Child:
    """One exercise's run, forked by the starter in a session of its own."""

    def __init__(self, ex_id, pid, num_cases, fd, out, timeout, starter: Starter):
        self.ex_id, self.pid, self.num_cases, self.fd, self.out = ex_id, pid, num_cases, fd, out
        self.timeout, self.starter = timeout, starter
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
        return self.pid is None or self.pid in self.starter.ended or not self.starter.alive

    def finish(self) -> ChildRun:
        """Stop it if it still runs, kill what it left behind, and read everything it sent."""
        timed_out = not self.exited()
        too_much = len(self.buffer) > MAX_OUTPUT
        self.kill()
        for _ in range(100):               # the starter reports the end of a killed child at once
            if self.exited():
                break
            time.sleep(0.01)
            self.starter.poll()
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
        grader (reaper.py); without a subreaper (not Linux), its session's process group and the child."""
        if self.pid is None:
            return
        if reaper.CAN_REAP:
            reaper.kill_tree({self.pid} | reaper.strays(self.starter.known), ours=self.starter.known)
            return
        for kill in (os.killpg, os.kill):
            try:
                kill(self.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def parse_messages(data: bytes) -> tuple[list[dict], int]:
    """The JSON objects, one per line, and how many lines were something else."""
    messages, stray = [], 0
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        try:
            message = json.loads(line)
        except (ValueError, RecursionError):
            message = None
        if isinstance(message, dict):
            messages.append(message)
        else:
            stray += 1
    return messages, stray


def run_children(jobs: list[tuple[str, dict]], folder: Path, timeout: float, parallel: int,
                 user: str | None) -> dict[str, ChildRun]:
    """Run each exercise's job in a child of its own, `parallel` at a time; what each sent, by exercise id."""
    pending, running, done = list(jobs), [], {}
    if not jobs:
        return done
    was_subreaper = reaper.set_subreaper(True) if reaper.CAN_REAP else False
    before = reaper.strays(set()) if reaper.CAN_REAP else set()
    starter = Starter(folder, user)
    starter.known = before | {starter.proc.pid}
    selector = selectors.PollSelector()
    try:
        while pending or running:
            while pending and len(running) < parallel:
                ex_id, job = pending.pop(0)
                child = starter.start(ex_id, job, folder, timeout)
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
    finally:
        for child in running:
            child.kill()
        starter.close()
        if reaper.CAN_REAP:      # what the starter's end handed back; then nothing of the graded code is left
            left = reaper.strays(before)
            reaper.kill_tree(left, ours=before)
            alive = reaper.wait_until_gone(left)
            reaper.set_subreaper(was_subreaper)
            if alive:
                raise RuntimeError(f"processes of the graded code outlived its kill: {sorted(alive)}")
    return done
