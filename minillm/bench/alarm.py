"""One time limit for the tools: stop a block of code after a while, never inside a CUDA graph capture.

    with time_limit(30, "the test ran for over 30 s"):
        ...                     # raises Alarm("the test ran for over 30 s") once 30 s have passed

gpu_check.py bounds each of its stages with it, and tests/conftest.py each
exercise test (a student's endless loop). It is a tool, not a concept of the
course.

Two choices make it safe to use around code we do not control:
- `Alarm` is a BaseException, like KeyboardInterrupt: an `except Exception`
  in the code it stops (a lesson's, transformers') cannot swallow it, so a
  stage cannot run on past its limit;
- it is never raised while the current CUDA stream is capturing a graph: an
  exception there would leave the stream in capture mode and every later CUDA
  call failing. The alarm rings again a moment later, once the capture is over.

It uses SIGALRM, so it works in the main thread of a POSIX process; elsewhere
(Windows, another thread) the block runs without a limit. Limits do not nest.
"""
from __future__ import annotations

import contextlib
import signal
import sys
import threading

RETRY_S = 0.01  # how soon a deferred alarm rings again


class Alarm(BaseException):
    """A time limit ran out."""


def capturing() -> bool:
    """True while this thread's current CUDA stream is capturing a graph (False where CUDA never started)."""
    torch = sys.modules.get("torch")  # torch is not imported for code that never used it
    return torch is not None and torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def can_limit() -> bool:
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def time_limit(seconds: float, message: str):
    """Raise Alarm(message) in this block once `seconds` have passed (deferred while a CUDA graph is captured)."""
    if not can_limit():
        yield
        return

    def ring(signum, frame):
        if capturing():
            signal.setitimer(signal.ITIMER_REAL, RETRY_S)
            return
        raise Alarm(message)

    previous = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1e-3))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
