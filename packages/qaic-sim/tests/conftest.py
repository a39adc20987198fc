"""Every test starts from a fresh simulated machine: the default Ultra card, no faults, no tracing."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from qaic_sim.machine import reset_machine

SIM_ENV = (
    "QAIC_SIM_CONFIG",
    "QAIC_SIM_TOPOLOGY",
    "QAIC_SIM_FAULTS",
    "QAIC_SIM_TRACE_DIR",
    "QAIC_SIM_PACE",
    "QAIC_SIM_PACE_AS",
    "QAIC_SIM_THREADS",
    "QAIC_SIM_TIMING",
    "QAIC_SIM_FUSED_ATTENTION",
    "QAIC_VISIBLE_DEVICES",
)


@pytest.fixture(autouse=True)
def fresh_topology(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts from the default Ultra card, no faults, no tracing, no env overrides."""
    for name in SIM_ENV:
        monkeypatch.delenv(name, raising=False)
    reset_machine()
    yield
    monkeypatch.undo()  # the test's environment first, so the next machine is built from the real one
    reset_machine()
