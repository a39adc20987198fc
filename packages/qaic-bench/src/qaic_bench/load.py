"""Part 10: the device under a paced load: how busy it is, and how much of its work is padding.

Method: vLLM's engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), paced as the
report's pacing model, and generates the serve workload (same prompt and output lengths, requests
and batch) once with asynchronous scheduling and once without. The device's modelled busy time
comes from the runtime's performance counters (``Util.getPerformanceInfo``: ``deviceTimeS`` summed
over the QIDs) before and after; ``busy_fraction`` is that time over the wall time of the
generation, and ``idle_us_per_step`` the wall time the device was not busy, per runner step (the
start and the end of the workload included). ``decode_wait_us``: from a trace of the run taken
through the backend's ``trace`` control (``trace.json`` only), the time the device stood idle
between one decode run's end and the next decode run's start, median and 90th percentile over the
workload: the host work between two decode steps the device waits for (sampling the last step,
preparing and handing over the next). Padding waste comes from the runner's step records (the
``qaic_observers`` hook): token positions the device computed over the tokens the requests needed, for prefill (chunks
padded to their compiled length, a batched prefill's empty rows) and decode (every KV slot of a
full-batch decode, busy or not) separately; 1.0 means no padding.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from qaic_bench.eager import device_seconds
from qaic_bench.host import observing
from qaic_bench.server import ServeShape
from qaic_bench.stack import random_prompts
from qaic_core import get_plugin_manager
from qaic_core.observe import Observer, StepRecord


class StepTotals(Observer):
    """Sums the runner's step records."""

    def __init__(self) -> None:
        self.steps: list[StepRecord] = []

    def step(self, record: StepRecord) -> None:
        self.steps.append(record)

    def waste(self) -> dict[str, float | None]:
        prefill_needed = sum(s.prefill_tokens for s in self.steps)
        decode_needed = sum(s.decode_tokens for s in self.steps)
        return {
            "prefill": round(sum(s.prefill_computed for s in self.steps) / prefill_needed, 3)
            if prefill_needed
            else None,
            "decode": round(sum(s.decode_computed for s in self.steps) / decode_needed, 3)
            if decode_needed
            else None,
        }


class DecodeHandOvers(Observer):
    """When each decode run was waited for and the next one handed over, as the stack's sessions report them.

    A decode is a run whose ``input_ids`` hold one token per row. ``own_us`` pairs each decode
    hand-over with the wait for the decode before it when nothing ran in between: the stack's own
    host work between the two (sampling, writing the next decode's tokens, the hand-over), without
    the runtime's completion of the first run.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.events: list[tuple[str, float]] = []
        self._decode_execs: set[int] = set()

    def run_submitted(self, inputs: Mapping[str, np.ndarray], exec_index: int, seconds: float) -> None:
        ids = inputs.get("input_ids")
        decode = ids is not None and ids.ndim == 2 and ids.shape[1] == 1
        if decode:
            self._decode_execs.add(exec_index)
        self.events.append(("decode" if decode else "other", self.clock()))

    def run_waited(self, exec_index: int, seconds: float) -> None:
        self.events.append(("waited-decode" if exec_index in self._decode_execs else "waited", self.clock()))

    def own_us(self) -> list[float]:
        return [
            (t_next - t_wait) * 1e6
            for (kind, t_wait), (next_kind, t_next) in itertools.pairwise(self.events)
            if kind == "waited-decode" and next_kind == "decode"
        ]


def _spread(values: list[float]) -> dict[str, float | int] | None:
    if not values:
        return None
    return {
        "median": round(statistics.median(values), 1),
        "p90": round(statistics.quantiles(values, n=10)[-1], 1) if len(values) > 1 else round(values[0], 1),
        "count": len(values),
    }


def decode_waits(trace_json: Path) -> list[float]:
    """Microseconds the device stood idle between consecutive decode runs, from a simulator ``trace.json``.

    A run's device span starts when the device started it; it ends when the run finished (the end of
    its host span: the modelled time, or the simulator's compute if that took longer).
    """
    events = json.loads(trace_json.read_text())["traceEvents"]
    runs: dict[int, dict[str, Any]] = {}
    for e in events:
        if e.get("ph") == "X":
            runs.setdefault(e["args"]["run"], {})[e["cat"]] = e
    spans = sorted(
        (r["device"]["ts"], r["host"]["ts"] + r["host"]["dur"], r["device"]["name"])
        for r in runs.values()
        if "device" in r and "host" in r
    )
    return [
        max(start - end, 0.0)
        for (_, end, before), (start, _, after) in itertools.pairwise(spans)
        if "decode" in before.lower() and "decode" in after.lower()
    ]


def paced_load(
    model_dir: Path,
    shape: ServeShape,
    dtype: str,
    input_len: int,
    output_len: int,
    num_prompts: int,
    async_scheduling: bool,
) -> dict[str, Any]:
    """One paced generation of the workload; output tok/s, the device's busy fraction and padding waste."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    totals = StepTotals()
    hand_overs = DecodeHandOvers()
    with observing(totals, hand_overs, name="qaic-bench-load"):
        llm = LLM(
            model=str(model_dir),
            max_num_seqs=shape.max_num_seqs,
            max_model_len=shape.max_model_len,
            long_prefill_token_threshold=shape.prefill_seq_len,
            dtype=dtype,  # type: ignore[arg-type]
            async_scheduling=async_scheduling,
            additional_config=shape.additional_config() or {},
            seed=0,
        )
        vocab = llm.get_tokenizer().vocab_size
        params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
        warm = random_prompts([input_len] * shape.max_num_seqs, vocab, seed=99)
        llm.generate([{"prompt_token_ids": p} for p in warm], params, use_tqdm=False)  # type: ignore[arg-type]
        prompts = [{"prompt_token_ids": p} for p in random_prompts([input_len] * num_prompts, vocab, seed=1)]
        totals.steps.clear()
        hand_overs.events.clear()
        # The backend's trace control (the simulator's: a Chrome trace with host and device spans).
        trace = get_plugin_manager().select_device_backend().trace
        with tempfile.TemporaryDirectory(prefix="qaic-bench-load-") as trace_dir:
            if trace is not None:
                trace.start(trace_dir, run_dirs=False)
            device0 = device_seconds()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)  # type: ignore[arg-type]
            wall = time.perf_counter() - t0
            device = device_seconds() - device0
            trace_json = trace.stop() if trace is not None else None
            waits = decode_waits(trace_json) if trace_json is not None else []
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "async_scheduling": async_scheduling,
        "tok_s": round(tokens / wall, 2),
        "wall_s": round(wall, 3),
        "device_s": round(device, 3),
        "busy_fraction": round(device / wall, 3) if wall > 0 else None,
        # What the device waits for per step: host work not hidden behind its runs.
        "idle_us_per_step": round((wall - device) / len(totals.steps) * 1e6, 1) if totals.steps else None,
        "decode_wait_us": _spread(waits),
        # Of that wait, the stack's own work: from the wait's return to the next decode's hand-over.
        "own_us": _spread(hand_overs.own_us()),
        "padding_waste": totals.waste(),
        "steps": len(totals.steps),
    }
