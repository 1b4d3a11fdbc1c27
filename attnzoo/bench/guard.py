"""A hard time limit on one benchmarked call: a SIGALRM timer that raises inside the call.

Why: a row's first call can hide minutes of work before any measurement exists (torch.compile of a
FlexAttention score_mod, Triton autotuning, an eager reference that loops over every prefix), and
nothing else interrupts it. The exception is raised between Python bytecodes, so it lands at the
next Python-level step of the call (between two torch ops, between two kernel launches); a single
long C++/CUDA op finishes first. Work already queued on the GPU still runs: the caller synchronises
afterwards.

Only the main thread of a POSIX process can take signals; elsewhere the limit is not enforced (the
budget checks between rows still are). An ITIMER_REAL timer armed by someone else (pytest-timeout's
signal method) is put back with its remaining time when the guarded call ends.
"""
from __future__ import annotations

import math
import signal
import threading
import time
from contextlib import contextmanager
from typing import Iterator, Optional


class CallInterrupted(Exception):
    """The call ran past its limit and was interrupted after ``seconds``."""

    def __init__(self, seconds: float, limit: float):
        super().__init__(f"interrupted after {seconds:.3g} s (limit {limit:.3g} s)")
        self.seconds = seconds
        self.limit = limit


def can_interrupt() -> bool:
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


@contextmanager
def interrupt_after(limit: Optional[float]) -> Iterator[None]:
    """Run the body with at most ``limit`` seconds (None or inf: no limit; <= 0: refused at once)."""
    if limit is None or math.isinf(limit) or not can_interrupt():
        yield
        return
    if limit <= 0:
        raise CallInterrupted(0.0, limit)
    start = time.perf_counter()
    armed = [True]

    def on_alarm(signum, frame):
        if armed[0]:
            armed[0] = False
            raise CallInterrupted(time.perf_counter() - start, limit)

    previous_handler = signal.signal(signal.SIGALRM, on_alarm)
    previous_delay, previous_interval = signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        yield
    finally:
        try:
            armed[0] = False
            signal.setitimer(signal.ITIMER_REAL, 0)
        finally:
            signal.signal(signal.SIGALRM, previous_handler)
            if previous_delay > 0:  # someone else's timer: give it back what is left of its time
                left = previous_delay - (time.perf_counter() - start)
                signal.setitimer(signal.ITIMER_REAL, max(left, 1e-3), previous_interval)
