"""The seam between a serving runner and a KV connector that moves whole sequences' KV.

A runner that serves a slot-layout :class:`~qaic_core.execution.StepModel` hands the model to
its serving framework's KV connector once, after the model is open, when that connector
implements :class:`StepModelConsumer`. The connector then reads and writes slots only through
``read_slot_kv`` / ``write_slot_kv`` (capability ``slot_kv_transfer``), and only from inside
the framework's connector hooks, which the runner calls on its own thread between device steps:
no device call ever races the runner's own work.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from qaic_core.execution import StepModel


@runtime_checkable
class StepModelConsumer(Protocol):
    """A KV connector that moves one sequence's KV in and out of a :class:`StepModel` slot."""

    def bind_step_model(self, model: StepModel) -> None:
        """Called once by the runner with the model it steps; raises when the model cannot serve it."""
        ...
