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


def host_overhead(
    model_dir: Path, shape: ServeShape, dtype: str, input_len: int, output_len: int
) -> dict[str, Any]:
    """Median host microseconds per full decode step at batch ``shape.max_num_seqs``."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    clock = DeviceClock()
    undo = instrument_sessions(clock)
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
        samples: list[float] = []
        device: list[float] = []
        for round_ in range(2):
            for i, ids in enumerate(random_prompts([input_len] * batch, vocab, seed=round_)):
                engine.add_request(f"r{round_}-{i}", {"prompt_token_ids": ids}, params)
            while engine.has_unfinished_requests():
                clock.reset()
                t0 = time.perf_counter()
                engine.step()
                wall = time.perf_counter() - t0
                full = clock.decode_runs == 1 and clock.decode_rows == [batch]
                if round_ == 1 and clock.prefill_runs == 0 and full:
                    samples.append(wall - clock.seconds)
                    device.append(clock.seconds)
    finally:
        undo()
    if not samples:
        raise RuntimeError(
            f"no decode-only step with all {batch} slots busy was seen; raise the output length"
        )
    return {
        "host_us": statistics.median(samples) * 1e6,
        "device_us": statistics.median(device) * 1e6,
        "steps": len(samples),
        "batch": batch,
    }
