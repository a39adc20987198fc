"""Keeping a paced run's modelled end: sleep until a deadline and wake within microseconds of it."""

from __future__ import annotations

import os
import time

SPIN_S = 300e-6
"""How long before the deadline the sleep ends; the rest is spent yielding the processor."""

_yield = getattr(os, "sched_yield", lambda: time.sleep(0))  # sched_yield: POSIX only


def sleep_until(deadline: float) -> None:
    """Return at ``deadline`` (a ``time.perf_counter()`` value), not a tenth of a millisecond after it.

    An operating-system sleep overshoots by about 0.1 ms (more on a virtual or busy machine), which
    would stretch every paced run beyond its modelled time and make the host look slower to the
    device than it is. The thread sleeps until ``SPIN_S`` before the deadline and then yields the
    processor (``os.sched_yield``, which lets other threads and processes run) until the deadline
    passes. ``time.sleep(0)`` would not do: the kernel's timer slack (50 µs) stretches each call.
    """
    remaining = deadline - time.perf_counter()
    if remaining > SPIN_S:
        time.sleep(remaining - SPIN_S)
    while time.perf_counter() < deadline:
        _yield()
