"""Part 2: host time of a decode step in vLLM's engine with the QAIC runner, device time excluded.

Method: vLLM's engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with
``max_num_seqs`` = batch, and the bench registers an observer with the process's plugin manager
(the ``qaic_observers`` hook) before the engine starts. The sessions report the time of every run
handed over and waited for (``run_submitted``, ``run_waited``: buffer hand-over and device
execution), the scheduler and the runner report their phases, and the runner reports each step's
decode rows and prefill tokens. A step's host overhead is its wall time minus that device time.
Only decode-only steps with every slot busy count (no prefill chunk ran in them), and the median
over them is reported.
"""

from __future__ import annotations

import logging
import os
import statistics
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import qaic_core
from qaic_bench.server import ServeShape
from qaic_bench.stack import random_prompts
from qaic_bench.timers import PhaseTimers
from qaic_core.observe import Observer, StepRecord

log = logging.getLogger("qaic.bench")

PHASES = ("schedule", "runner", "sampling")
"""Phases the breakdown splits out: the QAIC scheduler's, the runner's whole step, its sampling."""


@dataclass
class DeviceClock(Observer):
    """What the stack reported since the last ``reset()``: device seconds, phase times and steps."""

    seconds: float = 0.0
    steps: list[StepRecord] = field(default_factory=list)
    phases: PhaseTimers = field(default_factory=PhaseTimers)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def reset(self) -> None:
        with self._lock:
            self.seconds, self.steps = 0.0, []
        self.phases.reset()

    def run_submitted(self, inputs: Mapping[str, np.ndarray], exec_index: int, seconds: float) -> None:
        with self._lock:
            self.seconds += seconds

    def run_waited(self, exec_index: int, seconds: float) -> None:
        with self._lock:
            self.seconds += seconds

    def phase(self, name: str, seconds: float) -> None:
        self.phases.add(name, seconds)

    def step(self, record: StepRecord) -> None:
        with self._lock:
            self.steps.append(record)

    def full_decode(self, batch: int) -> bool:
        """The runner ran one step since the reset: a decode of ``batch`` rows and no prefill chunk."""
        with self._lock:
            steps = list(self.steps)
        return len(steps) == 1 and steps[0].decode_rows == batch and steps[0].prefill_tokens == 0


class ObserverPlugin:
    """A qaic plugin whose only hook offers the given observers (``qaic_observers``)."""

    def __init__(self, observers: Sequence[Observer]) -> None:
        self.observers = list(observers)

    @qaic_core.hookimpl
    def qaic_observers(self) -> list[Observer]:
        return self.observers


@contextmanager
def observing(*observers: Observer, name: str = "qaic-bench") -> Iterator[ObserverPlugin]:
    """Register ``observers`` with the process's plugin manager while the block runs.

    Sessions, the scheduler and the runner read the observers when they are built, so the engine
    must be created inside the block.
    """
    pm = qaic_core.get_plugin_manager()
    plugin = ObserverPlugin(observers)
    if pm.register(plugin, name=name) is None:
        raise RuntimeError(f"the plugin manager refused the observer plugin {name!r}: {pm.load_errors}")
    try:
        yield plugin
    finally:
        pm.unregister(plugin)


def breakdown(wall: float, device: float, phases: dict[str, float]) -> dict[str, float]:
    """A step's host time split into scheduling, runner input/output work, sampling and the rest."""
    host = wall - device
    schedule = phases.get("schedule", 0.0)
    sampling = phases.get("sampling", 0.0)
    runner = max(phases.get("runner", 0.0) - device - sampling, 0.0) if "runner" in phases else 0.0
    return {
        "host": host,
        "schedule": schedule,
        "runner_inputs": runner,
        "sampling": sampling,
        "engine_other": host - schedule - runner - sampling,
    }


def host_overhead(
    model_dir: Path, shape: ServeShape, dtype: str, input_len: int, output_len: int
) -> dict[str, Any]:
    """Median host microseconds per full decode step at batch ``shape.max_num_seqs``."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    clock = DeviceClock()
    batch = shape.max_num_seqs
    steps: list[dict[str, float]] = []
    with observing(clock):
        llm = LLM(
            model=str(model_dir),
            max_num_seqs=batch,
            max_model_len=shape.max_model_len,
            long_prefill_token_threshold=shape.prefill_seq_len,
            dtype=dtype,  # type: ignore[arg-type]
            # One step at a time, so a step's wall time holds its own host work and device runs only.
            async_scheduling=False,
        )
        engine = llm.llm_engine
        vocab = llm.get_tokenizer().vocab_size
        params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
        # A warm-up round, then the measured round.
        for round_ in range(2):
            for i, ids in enumerate(random_prompts([input_len] * batch, vocab, seed=round_)):
                engine.add_request(f"r{round_}-{i}", {"prompt_token_ids": ids}, params)
            while engine.has_unfinished_requests():
                clock.reset()
                t0 = time.perf_counter()
                engine.step()
                wall = time.perf_counter() - t0
                if round_ == 1 and clock.full_decode(batch):
                    phases = dict(clock.phases.seconds)
                    steps.append({"device": clock.seconds, **breakdown(wall, clock.seconds, phases)})
    if not steps:
        raise RuntimeError(
            f"no decode-only step with all {batch} slots busy was seen; raise the output length"
        )
    medians = {k: statistics.median(st[k] for st in steps) * 1e6 for k in steps[0]}
    return {
        "host_us": medians.pop("host"),
        "device_us": medians.pop("device"),
        "phases_us": medians,
        "missing_phases": clock.phases.missing(PHASES),
        "steps": len(steps),
        "batch": batch,
    }
