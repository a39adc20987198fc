"""Per-phase wall time of engine steps, as the stack reports it to observers (``Observer.phase``).

The scheduler reports ``schedule``, the runner ``runner`` (its whole ``execute_model``) and
``sampling``; nothing measured is patched. ``seen`` keeps every phase ever reported, so a phase
that a component never reports shows as missing rather than as zero.
"""

from __future__ import annotations

import threading
from collections import defaultdict


class PhaseTimers:
    """Seconds per phase since the last ``reset()``, summed over every report."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.seen: set[str] = set()
        self._lock = threading.Lock()

    def reset(self) -> None:
        with self._lock:
            self.seconds = defaultdict(float)

    def add(self, phase: str, seconds: float) -> None:
        with self._lock:
            self.seconds[phase] += seconds
            self.seen.add(phase)

    def missing(self, expected: tuple[str, ...]) -> list[str]:
        """The phases of ``expected`` never reported since these timers were made."""
        return [phase for phase in expected if phase not in self.seen]
