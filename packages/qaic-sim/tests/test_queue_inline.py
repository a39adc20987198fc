"""Unpaced runs execute in the caller's thread, held from enqueue until first needed, unless another run is queued on the same devices."""

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
def runs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, str]]:
    """(exec object id, thread name) of each run, in the order the runs executed."""
    seen: list[tuple[int, str]] = []
    execute = ExecObj.execute

    def recording(self: ExecObj, *args: Any, **kwargs: Any) -> Any:
        seen.append((self.id, threading.current_thread().name))
        return execute(self, *args, **kwargs)

    monkeypatch.setattr(ExecObj, "execute", recording)
    return seen


def _threads(runs: list[tuple[int, str]]) -> list[str]:
    """The name of the thread each run executed on, in order."""
    return [name for _, name in runs]


def _program(tmp_path: Path) -> tuple[qaicrt.Context, qaicrt.Program, np.ndarray]:
    onnx_path, w = write_matmul_model(tmp_path / "mm.onnx", width=WIDTH)
    qpc = compile_program(tmp_path / "p", onnx_path, [Specialization("b2", {"batch_size": 2})], flags=())
    ctx = qaicrt.Context()
    program = qaicrt.Program(ctx, 0, qaicrt.Qpc(str(qpc)))
    assert program.load() == QStatus.SUCCESS and program.activate() == QStatus.SUCCESS
    return ctx, program, w


def _enqueued(
    ctx: qaicrt.Context, program: qaicrt.Program, queue: qaicrt.Queue, x: np.ndarray
) -> tuple[ExecObj, np.ndarray]:
    exe = qaicrt.ExecObj(ctx, program)
    y = np.zeros((2, WIDTH), np.float32)
    assert exe.setData([(0, x), (1, y)]) == QStatus.SUCCESS
    assert queue.enqueue(exe) == QStatus.SUCCESS
    return exe, y


def _run(ctx: qaicrt.Context, program: qaicrt.Program, queue: qaicrt.Queue, x: np.ndarray) -> np.ndarray:
    exe, y = _enqueued(ctx, program, queue, x)
    assert exe.waitForCompletion() == QStatus.SUCCESS
    return y


def test_an_unpaced_run_executes_in_the_callers_thread(tmp_path: Path, runs: list[tuple[int, str]]) -> None:
    ctx, program, w = _program(tmp_path)
    x = np.ones((2, WIDTH), np.float32)
    y = _run(ctx, program, qaicrt.Queue(ctx, 0), x)
    np.testing.assert_allclose(y, np.tanh(x @ w), rtol=1e-5)
    assert _threads(runs) == [threading.current_thread().name]


def test_a_paced_run_keeps_the_queue_thread(
    tmp_path: Path, runs: list[tuple[int, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QAIC_SIM_PACE", "1")
    reset_machine()
    ctx, program, _ = _program(tmp_path)
    _run(ctx, program, qaicrt.Queue(ctx, 0), np.ones((2, WIDTH), np.float32))
    assert _threads(runs)[0].startswith("qaic-sim-q")


def test_a_run_behind_a_queued_one_waits_in_the_queue(tmp_path: Path, runs: list[tuple[int, str]]) -> None:
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
    threads = _threads(runs)
    assert threads[0].startswith("qaic-sim-q") and threads[1] == threading.current_thread().name


def test_an_unpaced_run_executes_at_its_wait_not_at_enqueue(
    tmp_path: Path, runs: list[tuple[int, str]]
) -> None:
    ctx, program, w = _program(tmp_path)
    x = np.full((2, WIDTH), 0.25, np.float32)
    exe, y = _enqueued(ctx, program, qaicrt.Queue(ctx, 0), x)
    assert runs == [] and not y.any()  # enqueue returned before the run
    assert exe.waitForCompletion() == QStatus.SUCCESS
    assert runs == [(exe.id, threading.current_thread().name)]
    np.testing.assert_allclose(y, np.tanh(x @ w), rtol=1e-5)
    assert exe.waitForCompletion() == QStatus.SUCCESS and len(runs) == 1  # a second wait runs nothing


def test_a_held_run_executes_before_the_next_enqueue_on_its_devices(
    tmp_path: Path, runs: list[tuple[int, str]]
) -> None:
    ctx, program, w = _program(tmp_path)
    queue = qaicrt.Queue(ctx, 0)
    xa, xb = np.full((2, WIDTH), 0.5, np.float32), np.full((2, WIDTH), -1.0, np.float32)
    a, ya = _enqueued(ctx, program, queue, xa)
    b, yb = _enqueued(ctx, program, qaicrt.Queue(ctx, 0), xb)  # another queue, the same device
    assert [r[0] for r in runs] == [a.id]  # a ran inside b's enqueue, b is held
    np.testing.assert_allclose(ya, np.tanh(xa @ w), rtol=1e-5)
    assert not yb.any()
    assert b.waitForCompletion() == QStatus.SUCCESS and a.waitForCompletion() == QStatus.SUCCESS
    assert [r[0] for r in runs] == [a.id, b.id]
    np.testing.assert_allclose(yb, np.tanh(xb @ w), rtol=1e-5)


def test_a_held_run_executes_once_when_another_thread_enqueues(
    tmp_path: Path, runs: list[tuple[int, str]]
) -> None:
    ctx, program, w = _program(tmp_path)
    x = np.ones((2, WIDTH), np.float32)
    a, ya = _enqueued(ctx, program, qaicrt.Queue(ctx, 0), x)
    other: dict[str, Any] = {}

    def enqueue_and_wait() -> None:
        b, yb = _enqueued(ctx, program, qaicrt.Queue(ctx, 0), 2 * x)
        other.update(b=b, y=yb, status=b.waitForCompletion())

    worker = threading.Thread(target=enqueue_and_wait, name="other-host-thread")
    worker.start()
    worker.join()
    assert a.waitForCompletion() == QStatus.SUCCESS and other["status"] == QStatus.SUCCESS
    assert runs == [(a.id, "other-host-thread"), (other["b"].id, "other-host-thread")]
    np.testing.assert_allclose(ya, np.tanh(x @ w), rtol=1e-5)
    np.testing.assert_allclose(other["y"], np.tanh(2 * x @ w), rtol=1e-5)


def test_deactivating_the_program_executes_its_held_run_first(
    tmp_path: Path, runs: list[tuple[int, str]]
) -> None:
    ctx, program, w = _program(tmp_path)
    x = np.full((2, WIDTH), 0.75, np.float32)
    exe, y = _enqueued(ctx, program, qaicrt.Queue(ctx, 0), x)
    assert program.deactivate() == QStatus.SUCCESS
    assert [r[0] for r in runs] == [exe.id]
    np.testing.assert_allclose(y, np.tanh(x @ w), rtol=1e-5)
    assert exe.waitForCompletion() == QStatus.SUCCESS and len(runs) == 1


def test_a_held_run_that_fails_reports_at_its_wait(tmp_path: Path, runs: list[tuple[int, str]]) -> None:
    ctx, program, _ = _program(tmp_path)
    exe = qaicrt.ExecObj(ctx, program)
    x, y = np.ones((3, WIDTH), np.float32), np.zeros((3, WIDTH), np.float32)  # no batch-3 specialization
    assert exe.setData([(0, x), (1, y)]) == QStatus.SUCCESS
    assert qaicrt.Queue(ctx, 0).enqueue(exe) == QStatus.SUCCESS
    assert exe.waitForCompletion() == QStatus.INVAL
    assert "Allowed shapes" in exe.lastError
    # the failed run gave the device back: the next run is held again and executes in this thread
    assert np.isfinite(_run(ctx, program, qaicrt.Queue(ctx, 0), np.ones((2, WIDTH), np.float32))).all()
    assert runs[-1][1] == threading.current_thread().name


def test_closing_the_machine_executes_a_held_run(tmp_path: Path, runs: list[tuple[int, str]]) -> None:
    ctx, program, w = _program(tmp_path)
    x = np.full((2, WIDTH), -0.5, np.float32)
    exe, y = _enqueued(ctx, program, qaicrt.Queue(ctx, 0), x)
    reset_machine()  # the machine the program was made on closes
    assert [r[0] for r in runs] == [exe.id]
    np.testing.assert_allclose(y, np.tanh(x @ w), rtol=1e-5)
