"""Typed test controls a device backend may offer on its descriptor: traces and fault injection.

A backend claiming the ``traces`` capability sets ``DeviceBackend.trace``; one claiming ``faults`` sets
``DeviceBackend.faults``. Callers use these members instead of importing modules by naming convention.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol, runtime_checkable

FAULT_KINDS = frozenset({"reset", "timeout", "dev_error", "nomem"})
"""Fault kinds a :class:`FaultControl` takes: a QID reset, a timed-out run, a failed run, a failed load."""


@runtime_checkable
class TraceControl(Protocol):
    """Records every device run of this process into a directory, one span at a time."""

    def start(self, directory: str | os.PathLike[str], run_dirs: bool = True) -> None:
        """Trace every run from now on into ``directory`` (stopping any earlier trace).

        ``run_dirs=False``: only the trace file, without a record per run (cheaper per run).
        """
        ...

    def stop(self) -> Path | None:
        """Stop tracing; the trace file written, or None when no trace was active."""
        ...

    @property
    def active(self) -> bool:
        """Whether runs are being traced now."""
        ...


@runtime_checkable
class FaultControl(Protocol):
    """Injects device faults so tests can drive error paths (kinds: :data:`FAULT_KINDS`)."""

    def inject(self, kind: str, qid: int = 0, at: int = 1) -> None:
        """Arm ``kind`` on QID ``qid`` for its ``at``-th next run (``nomem``: its ``at``-th next load)."""
        ...

    def clear(self) -> None:
        """Disarm every fault that has not fired yet."""
        ...

    def reset_device(self, qid: int) -> None:
        """Reset QID ``qid`` now: programs on it fail until they are loaded again."""
        ...
