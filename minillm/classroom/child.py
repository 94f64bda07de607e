"""The children's side: a fresh interpreter that starts one child per exercise, and what each child does.

The grader starts this file as `python -I child.py SOCKET_FD`, as the
unprivileged user, in the graded folder. This process, the starter, is a fresh
interpreter, never a fork of the grader: it has never seen a check, an oracle
or the seed. It imports torch and the graded package once, then for each
exercise the grader sends (three file descriptors over the socket: the job,
the file for what the code prints, the channel back) it forks a child in a
session of its own. The child reads its job, the source of the check's `run`
and the inputs as plain data, and sends back JSON lines: what the student's
function returned and which of its inputs it changed, or what it raised. The starter reports each child's pid and
how it ended; the grader decodes and judges everything alone, after killing
every process the child started (reaper.py).
"""
import json
import os
import socket
import sys
import traceback


def send(channel: int, message: dict) -> None:
    data = (json.dumps(message, allow_nan=True) + "\n").encode()
    while data:
        data = data[os.write(channel, data):]


def describe(e: BaseException, root: str) -> dict:
    try:
        text = str(e)[:3000]
    except BaseException:
        text = "(its message could not be read)"
    where = ""
    for frame in reversed(traceback.extract_tb(e.__traceback__)):
        path = os.path.abspath(frame.filename)
        if path.startswith(os.path.join(root, "minillm") + os.sep):
            where = f"{os.path.relpath(path, root)}:{frame.lineno}"
            break
    return {"type": type(e).__name__, "message": text, "where": where,
            "exit_code": str(e.code) if isinstance(e, SystemExit) else None}


def run_job(channel: int, root: str) -> None:
    """In a child: the job from stdin, each case's inputs through the caller, each output back as data."""
    job = json.loads(sys.stdin.buffer.read())
    os.close(0)
    os.environ["HOME"] = os.environ["TMPDIR"] = job["home"]   # this run's own, that only its user may enter
    import tempfile
    tempfile.tempdir = None
    from minillm.classroom.wire import changed_inputs, from_wire, to_wire
    namespace = {"__name__": "exercise_caller"}
    exec(compile(job["caller"], f"<the caller of exercise {job['exercise']}>", "exec"), namespace)
    caller = namespace["CALLER"]
    for i, name, inputs in job["cases"]:
        send(channel, {"start": name})
        try:
            given = from_wire(inputs)
            message = {"case": i, "output": to_wire(caller.run(given)), "changed": changed_inputs(inputs, given)}
        except BaseException as e:        # SystemExit and KeyboardInterrupt too: they end this case, not the run
            message = {"case": i, "raised": describe(e, root)}
        try:
            send(channel, message)
        except (TypeError, ValueError, RecursionError, OverflowError) as e:
            send(channel, {"case": i, "raised": {"type": "UnsendableOutput",
                                                 "message": f"the output cannot be sent: {e}"}})
    os.close(channel)


def fork_child(sock: socket.socket, fds: list[int], root: str) -> int:
    pid = os.fork()
    if pid:
        for fd in fds:
            os.close(fd)
        return pid
    code = 0
    try:
        sock.close()
        os.setsid()                     # a session of its own, and on Linux a subreaper: whatever its code starts
        if sys.platform.startswith("linux"):    # stays below it, for the grader to kill when its run ends
            from minillm.classroom.reaper import set_subreaper
            set_subreaper(True)
        job, out, channel = fds
        os.dup2(job, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(job)
        os.close(out)
        sys.stdout = open(1, "w", closefd=False, errors="backslashreplace")
        sys.stderr = open(2, "w", closefd=False, errors="backslashreplace")
        run_job(channel, root)
    except BaseException:
        traceback.print_exc()
        code = 70
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def confine(limits: dict) -> None:
    """Before anything else, and before any run forks: no process of this user may read this one's memory or
    take its file descriptors (not dumpable), no program it starts gains privileges, and every run meets the
    grader's rlimits (soft = hard: a run cannot raise them)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import resource
    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 4, 38
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) or libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0):
        raise OSError(ctypes.get_errno(), "prctl failed")
    for name, value in limits.items():
        resource.setrlimit(getattr(resource, name), (value, value))


def main() -> None:
    confine(json.loads(sys.argv[2]))
    sock = socket.socket(fileno=int(sys.argv[1]))
    root = os.getcwd()
    sys.path.insert(0, root)
    sys.dont_write_bytecode = True
    os.environ["OPENBLAS_NUM_THREADS"] = "1"  # numpy's BLAS too (one-row products on an AMD CPU), read as it loads
    import torch
    torch.set_num_threads(1)            # one core per child; children run side by side
    try:
        import minillm  # noqa: F401     the graded package, loaded once; each child gets its own copy by fork
    except BaseException:
        traceback.print_exc()           # each child will meet the same error, and report it for its exercise
    sock.setblocking(False)
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(sock, 4096, 3)
        except BlockingIOError:
            message, fds = None, []
        if message == b"":
            break                       # the grader is done
        if message:
            pid = fork_child(sock, fds, root)
            sock.sendall(json.dumps({"started": json.loads(message)["exercise"], "pid": pid}).encode())
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if not pid:
                break
            sock.sendall(json.dumps({"ended": pid, "code": os.waitstatus_to_exitcode(status)}).encode())
        if message is None:
            import select
            select.select([sock], [], [], 0.01)


if __name__ == "__main__":
    main()
