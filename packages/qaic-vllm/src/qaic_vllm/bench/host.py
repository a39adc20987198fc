"""Part 2: host time of a decode step in vLLM's engine with the QAIC runner, device time excluded.

Method: vLLM's engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with
``max_num_seqs`` = batch. Every session call (``QAICInferenceSession.submit`` and
``RunHandle.wait``: buffer hand-over and device execution) is timed; a step's host overhead is
its wall time minus that device time. Only decode-only steps with every slot busy count (no
prefill chunk ran in them), and the median over them is reported.
"""

from __future__ import annotations

import logging
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qaic_vllm.bench.server import ServeShape
from qaic_vllm.bench.stack import random_prompts
from qaic_vllm.bench.timers import PhaseTimers

log = logging.getLogger("qaic.bench")


@dataclass
class DeviceClock:
    """Seconds spent inside session calls on this thread, and what kind of run they were."""

    seconds: float = 0.0
    prefill_runs: int = 0
    decode_runs: int = 0
    decode_rows: list[int] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def reset(self) -> None:
        with self._lock:
            self.seconds, self.prefill_runs, self.decode_runs = 0.0, 0, 0
            self.decode_rows = []

    def add(self, seconds: float) -> None:
        with self._lock:
            self.seconds += seconds

    def classify(self, inputs: Any) -> None:
        """A run with one row of several tokens is a prefill chunk; else a decode of its busy rows."""
        ids, pos = inputs.get("input_ids"), inputs.get("position_ids")
        if ids is None or pos is None:
            return
        with self._lock:
            if ids.shape[0] == 1 and ids.shape[1] > 1:
                self.prefill_runs += 1
            else:
                self.decode_runs += 1
                self.decode_rows.append(int((pos[:, -1] >= 0).sum()))


def instrument_sessions(clock: DeviceClock) -> Callable[[], None]:
    """Time every ``submit`` and ``wait`` of qaic_aot sessions; returns a function that undoes it."""
    from qaic_aot import session as session_mod

    orig_submit = session_mod.QAICInferenceSession.submit
    orig_wait = session_mod.RunHandle.wait

    def submit(self: Any, inputs: Any, exec_index: int = 0) -> Any:
        clock.classify(inputs)
        t0 = time.perf_counter()
        try:
            return orig_submit(self, inputs, exec_index)
        finally:
            clock.add(time.perf_counter() - t0)

    def wait(self: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return orig_wait(self)
        finally:
            clock.add(time.perf_counter() - t0)

    session_mod.QAICInferenceSession.submit = submit  # type: ignore[method-assign]
    session_mod.RunHandle.wait = wait  # type: ignore[method-assign]

    def undo() -> None:
        session_mod.QAICInferenceSession.submit = orig_submit  # type: ignore[method-assign]
        session_mod.RunHandle.wait = orig_wait  # type: ignore[method-assign]

    return undo


PHASES = (
    ("qaic_vllm.scheduler", "QaicScheduler", "schedule", "schedule"),
    ("qaic_vllm.model_runner", "AotModelRunner", "execute_model", "runner"),
    ("qaic_vllm.model_runner", "AotModelRunner", "_sample", "sampling"),
)
"""Methods timed for the breakdown: (module, class, method, phase)."""


def wrap_phases(timers: PhaseTimers) -> None:
    """Time the scheduler, the runner and its sampler where they exist under these names."""
    import importlib

    for module, cls, method, phase in PHASES:
        try:
            owner = getattr(importlib.import_module(module), cls)
        except (ImportError, AttributeError):
            timers.missing.append(f"{module}.{cls}")
            continue
        timers.wrap(owner, method, phase)


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
    undo = instrument_sessions(clock)
    timers = PhaseTimers()
    wrap_phases(timers)
    batch = shape.max_num_seqs
    try:
        llm = LLM(
            model=str(model_dir),
            max_num_seqs=batch,
            max_model_len=shape.max_model_len,
            long_prefill_token_threshold=shape.prefill_seq_len,
            dtype=dtype,  # type: ignore[arg-type]
        )
        engine = llm.llm_engine
        vocab = llm.get_tokenizer().vocab_size
        params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
        # A warm-up round, then the measured round.
        steps: list[dict[str, float]] = []
        for round_ in range(2):
            for i, ids in enumerate(random_prompts([input_len] * batch, vocab, seed=round_)):
                engine.add_request(f"r{round_}-{i}", {"prompt_token_ids": ids}, params)
            while engine.has_unfinished_requests():
                clock.reset()
                timers.reset()
                t0 = time.perf_counter()
                engine.step()
                wall = time.perf_counter() - t0
                full = clock.decode_runs == 1 and clock.decode_rows == [batch]
                if round_ == 1 and clock.prefill_runs == 0 and full:
                    steps.append(
                        {"device": clock.seconds, **breakdown(wall, clock.seconds, dict(timers.seconds))}
                    )
    finally:
        timers.undo()
        undo()
    if not steps:
        raise RuntimeError(
            f"no decode-only step with all {batch} slots busy was seen; raise the output length"
        )
    medians = {k: statistics.median(st[k] for st in steps) * 1e6 for k in steps[0]}
    return {
        "host_us": medians.pop("host"),
        "device_us": medians.pop("device"),
        "phases_us": medians,
        "missing_phases": timers.missing,
        "steps": len(steps),
        "batch": batch,
    }
