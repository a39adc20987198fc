"""``sleep_until``: a paced run's end is its deadline, whatever the operating system's sleep does."""

from __future__ import annotations

import time

from qaic_sim.clock import SPIN_S, sleep_until


def test_it_never_returns_before_the_deadline() -> None:
    for delay in (0.0, SPIN_S / 3, 2 * SPIN_S, 0.005):
        deadline = time.perf_counter() + delay
        sleep_until(deadline)
        assert time.perf_counter() >= deadline
