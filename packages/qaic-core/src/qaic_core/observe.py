"""Observers: how tools (benchmarks, tests, profilers, metrics) see sessions, serving steps, compiles and faults.

An observer subclasses :class:`Observer` and overrides what it needs; every method is a no-op
by default. It is registered through the ``qaic_observers`` hook, for example by registering a
small plugin object with the process's plugin manager, so nothing it measures has to be patched.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from types import TracebackType

import numpy as np


@dataclass(frozen=True)
class StepRecord:
    """One serving step as the runner ran it."""

    decode_rows: int
    """Sequences decoded in the step's decode run (0 when no decode ran)."""
    prefill_tokens: int
    """Prompt tokens computed by the step's prefill chunks."""
    running: int
    """Requests the runner held when the step began."""
    decode_tokens: int = 0
    """Tokens the decode run was asked for: one per row, plus the drafts a row verifies."""
    decode_computed: int = 0
    """Token positions the decode run computed: every slot's, idle rows and unused draft places included."""
    prefill_computed: int = 0
    """Token positions the prefill runs computed: each chunk padded to its compiled length."""
    prefill_runs: int = 0
    """Prefill runs on the device (a batched prefill of several chunks is one run)."""


class Observer:
    """Receives timings of device runs and serving steps; override the methods you need."""

    def run_submitted(self, inputs: Mapping[str, np.ndarray], exec_index: int, seconds: float) -> None:
        """A run was handed to the device; ``seconds`` spent in the hand-over."""

    def run_waited(self, exec_index: int, seconds: float) -> None:
        """A caller waited ``seconds`` for a run to finish (and its outputs to be read)."""

    def phase(self, name: str, seconds: float) -> None:
        """A named part of a serving step (``schedule``, ``runner``, ``sampling``) took ``seconds``."""

    def step(self, record: StepRecord) -> None:
        """A serving step finished."""

    def program_compiled(self, cached: bool, seconds: float) -> None:
        """A program was wanted: taken from the compile cache (``cached``) or compiled in ``seconds``."""

    def device_fault(self, kind: str) -> None:
        """A device run failed; ``kind`` is the runtime status' name in lower case (``dev_error``, ``timedout``)."""

    def program_reloaded(self) -> None:
        """The program was loaded onto its devices again after a fault."""


class Observers(Observer):
    """Several observers behind one; what the stack calls so callers need no loop or None check."""

    def __init__(self, observers: Sequence[Observer] = ()) -> None:
        self.observers = tuple(observers)

    def __bool__(self) -> bool:
        return bool(self.observers)

    def run_submitted(self, inputs: Mapping[str, np.ndarray], exec_index: int, seconds: float) -> None:
        for observer in self.observers:
            observer.run_submitted(inputs, exec_index, seconds)

    def run_waited(self, exec_index: int, seconds: float) -> None:
        for observer in self.observers:
            observer.run_waited(exec_index, seconds)

    def phase(self, name: str, seconds: float) -> None:
        for observer in self.observers:
            observer.phase(name, seconds)

    def step(self, record: StepRecord) -> None:
        for observer in self.observers:
            observer.step(record)

    def program_compiled(self, cached: bool, seconds: float) -> None:
        for observer in self.observers:
            observer.program_compiled(cached, seconds)

    def device_fault(self, kind: str) -> None:
        for observer in self.observers:
            observer.device_fault(kind)

    def program_reloaded(self) -> None:
        for observer in self.observers:
            observer.program_reloaded()

    def timed(self, name: str) -> AbstractContextManager[object]:
        """A block whose wall time is reported as phase ``name``, also when it raises (untimed without observers)."""
        return _Phase(self, name) if self.observers else nullcontext()


class _Phase:
    def __init__(self, observers: Observers, name: str) -> None:
        self.observers, self.name = observers, name
        self.start = 0.0

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.observers.phase(self.name, time.perf_counter() - self.start)
