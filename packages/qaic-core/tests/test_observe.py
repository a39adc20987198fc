"""``Observers.timed``: a block's wall time reaches every observer as a phase, also when it raises."""

from __future__ import annotations

import time

import pytest

from qaic_core.observe import Observer, Observers


class Phases(Observer):
    def __init__(self) -> None:
        self.seen: list[tuple[str, float]] = []

    def phase(self, name: str, seconds: float) -> None:
        self.seen.append((name, seconds))


def test_a_timed_block_reports_its_phase_to_every_observer() -> None:
    first, second = Phases(), Phases()
    with Observers([first, second]).timed("schedule"):
        time.sleep(0.01)
    assert [name for name, _ in first.seen] == [name for name, _ in second.seen] == ["schedule"]
    assert first.seen[0][1] >= 0.01


def test_a_block_that_raises_is_reported_and_the_error_goes_on() -> None:
    phases = Phases()
    with pytest.raises(ValueError, match="bad step"), Observers([phases]).timed("runner"):
        raise ValueError("bad step")
    assert [name for name, _ in phases.seen] == ["runner"]


def test_without_observers_nothing_is_timed() -> None:
    with Observers().timed("runner") as value:
        assert value is None
