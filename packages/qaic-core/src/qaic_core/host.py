"""The host machine as the stack's packages size their work to it."""

from __future__ import annotations

import os


def usable_cpus() -> int:
    """Cores this process may run on: its affinity mask where the platform has one, else every core."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
