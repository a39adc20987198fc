"""The runner's step output, with what a device fault cost (read by the qaic scheduler)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.v1.outputs import ModelRunnerOutput


@dataclass
class QaicRunnerOutput(ModelRunnerOutput):
    """A step's output that also names the requests a device fault cost, with the cause."""

    failed: dict[str, str] = field(default_factory=dict)
    """Request id -> the error its client gets."""
    recompute: bool = False
    """Put the failed requests back to be computed again from their tokens instead."""
