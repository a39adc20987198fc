"""onnxruntime threads per program: the ``threads`` setting, else every usable core but one."""

from __future__ import annotations

import gc
import os
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from sim_programs import compile_program, run_once, write_matmul_model

from qaic_core.host import usable_cpus
from qaic_core.types import Specialization
from qaic_sim.config import onnx_threads
from qaic_sim.machine import get_machine, reset_machine


def test_unset_threads_leave_one_core_to_the_host() -> None:
    assert onnx_threads(0, cpus=16) == 15
    assert onnx_threads(0, cpus=2) == 1
    assert onnx_threads(0, cpus=1) == 1  # never none
    assert onnx_threads(3, cpus=2) == 3  # a set value is taken as it is


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _settle_queue_threads() -> None:
    """Let the queue workers of earlier tests' queues end first: a queue dropped by the garbage
    collector shuts its pool down without waiting, and its worker leaving during the count would
    change it."""
    gc.collect()
    for thread in threading.enumerate():
        if thread.name.startswith("qaic-sim-q"):
            thread.join(timeout=2.0)


@pytest.mark.parametrize("setting", ["", "3"])
def test_a_programs_session_runs_on_the_resolved_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setting: str
) -> None:
    if setting:
        monkeypatch.setenv("QAIC_SIM_THREADS", setting)
    reset_machine()
    want = int(setting) if setting else max(1, usable_cpus() - 1)
    onnx_path, w = write_matmul_model(tmp_path / "mm.onnx", width=16)
    qpc = compile_program(tmp_path / "c", onnx_path, [Specialization("b2", {"batch_size": 2})], flags=())
    x = np.random.default_rng(0).standard_normal((2, 16)).astype(np.float32)
    _settle_queue_threads()
    before = _os_threads() if sys.platform == "linux" else 0
    np.testing.assert_allclose(run_once(qpc, x), np.tanh(x @ w), rtol=1e-5, atol=1e-6)
    assert get_machine().images.open(qpc).threads == want
    if sys.platform == "linux":  # onnxruntime's pool: the calling thread and want - 1 workers
        assert _os_threads() - before == want - 1
