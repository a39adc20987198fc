"""Unpaced runs execute in the caller's thread unless another run is queued on the same devices."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sim_programs import compile_program, write_matmul_model

from qaic_core.types import Specialization
from qaic_sim import qaicrt
from qaic_sim.execobj import ExecObj
from qaic_sim.machine import get_machine, reset_machine
from qaic_sim.qaicrt import QStatus

WIDTH = 8


@pytest.fixture
def threads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The name of the thread each run executed on, in order."""
    seen: list[str] = []
    execute = ExecObj.execute

    def recording(self: ExecObj, *args: Any, **kwargs: Any) -> Any:
        seen.append(threading.current_thread().name)
        return execute(self, *args, **kwargs)

    monkeypatch.setattr(ExecObj, "execute", recording)
    return seen


def _program(tmp_path: Path) -> tuple[qaicrt.Context, qaicrt.Program, np.ndarray]:
    onnx_path, w = write_matmul_model(tmp_path / "mm.onnx", width=WIDTH)
    qpc = compile_program(tmp_path / "p", onnx_path, [Specialization("b2", {"batch_size": 2})], flags=())
    ctx = qaicrt.Context()
    program = qaicrt.Program(ctx, 0, qaicrt.Qpc(str(qpc)))
    assert program.load() == QStatus.SUCCESS and program.activate() == QStatus.SUCCESS
    return ctx, program, w


def _run(ctx: qaicrt.Context, program: qaicrt.Program, queue: qaicrt.Queue, x: np.ndarray) -> np.ndarray:
    exe = qaicrt.ExecObj(ctx, program)
    y = np.zeros((2, WIDTH), np.float32)
    assert exe.setData([(0, x), (1, y)]) == QStatus.SUCCESS
    assert queue.enqueue(exe) == QStatus.SUCCESS
    assert exe.waitForCompletion() == QStatus.SUCCESS
    return y


def test_an_unpaced_run_executes_in_the_callers_thread(tmp_path: Path, threads: list[str]) -> None:
    ctx, program, w = _program(tmp_path)
    x = np.ones((2, WIDTH), np.float32)
    y = _run(ctx, program, qaicrt.Queue(ctx, 0), x)
    np.testing.assert_allclose(y, np.tanh(x @ w), rtol=1e-5)
    assert threads == [threading.current_thread().name]


def test_a_paced_run_keeps_the_queue_thread(
    tmp_path: Path, threads: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QAIC_SIM_PACE", "1")
    reset_machine()
    ctx, program, _ = _program(tmp_path)
    _run(ctx, program, qaicrt.Queue(ctx, 0), np.ones((2, WIDTH), np.float32))
    assert threads[0].startswith("qaic-sim-q")


def test_a_run_behind_a_queued_one_waits_in_the_queue(tmp_path: Path, threads: list[str]) -> None:
    ctx, program, w = _program(tmp_path)
    queue = qaicrt.Queue(ctx, 0)
    machine = get_machine()
    machine.queued(program.devices, 1)  # as if another exec object's run were queued on QID 0
    try:
        x = np.full((2, WIDTH), 0.5, np.float32)
        np.testing.assert_allclose(_run(ctx, program, queue, x), np.tanh(x @ w), rtol=1e-5)
    finally:
        machine.queued(program.devices, -1)
    _run(ctx, program, queue, x)
    assert threads[0].startswith("qaic-sim-q") and threads[1] == threading.current_thread().name
