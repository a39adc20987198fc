"""Per-phase wall time of engine steps: methods wrapped in-process, no change to the code measured.

``PhaseTimers.wrap(cls, "method", "phase")`` adds the time spent in ``cls.method`` to ``phase``
(outermost call only, so a phase that calls itself is not counted twice); ``undo()`` restores
every method. A method that does not exist is skipped and listed in ``missing``, so a renamed
internal shows as a missing phase rather than a crash.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any


class PhaseTimers:
    """Seconds per phase since the last ``reset()``, summed over every wrapped call."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.missing: list[str] = []
        self._undo: list[Callable[[], None]] = []
        self._depth: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()

    def reset(self) -> None:
        with self._lock:
            self.seconds = defaultdict(float)

    def add(self, phase: str, seconds: float) -> None:
        with self._lock:
            self.seconds[phase] += seconds

    def wrap(self, owner: Any, name: str, phase: str) -> bool:
        """Time ``owner.name`` as ``phase``; False (and noted in ``missing``) when it does not exist."""
        original = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
        if original is None or not callable(original):
            self.missing.append(f"{getattr(owner, '__name__', owner)}.{name}")
            return False

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            outer = self._depth[phase] == 0
            self._depth[phase] += 1
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self._depth[phase] -= 1
                if outer:
                    self.add(phase, time.perf_counter() - t0)

        setattr(owner, name, timed)
        self._undo.append(lambda: setattr(owner, name, original))
        return True

    def undo(self) -> None:
        """Put every wrapped method back, last wrapped first."""
        while self._undo:
            self._undo.pop()()
