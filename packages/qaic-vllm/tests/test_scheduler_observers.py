"""The QAIC scheduler reports the time of each ``schedule()`` to the registered observers."""

from __future__ import annotations

from typing import Any

from qaic_core.observe import Observer, Observers
from qaic_vllm.scheduler import QaicScheduler


class PhaseRecorder(Observer):
    def __init__(self) -> None:
        self.phases: list[tuple[str, float]] = []

    def phase(self, name: str, seconds: float) -> None:
        self.phases.append((name, seconds))


def _scheduler(observers: Observers, result: Any) -> QaicScheduler:
    """A scheduler without vLLM's engine state: only what ``schedule()`` around the work reads."""
    scheduler = object.__new__(QaicScheduler)
    scheduler.observers = observers
    scheduler._schedule = lambda throttle_prefills: result  # type: ignore[method-assign]
    return scheduler


def test_schedule_reports_the_schedule_phase() -> None:
    recorder = PhaseRecorder()
    out = object()
    assert _scheduler(Observers([recorder]), out).schedule() is out
    assert [name for name, _ in recorder.phases] == ["schedule"]
    assert recorder.phases[0][1] >= 0.0


def test_schedule_without_observers_reports_nothing() -> None:
    out = object()
    assert _scheduler(Observers(), out).schedule() is out
