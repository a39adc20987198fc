"""Fault injection: resets isolated to one QID and cured by reloading, timeouts, errors, NOMEM."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from sim_programs import D, KvReference, compile_program, kv_specs, write_kv_model

from qaic_core.errors import QaicConfigError
from qaic_sim import qaicrt
from qaic_sim.machine import get_machine, reset_machine
from qaic_sim.qaicrt import QStatus


@pytest.fixture(scope="module")
def kv(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray]:
    root = tmp_path_factory.mktemp("faults")
    onnx_path, w = write_kv_model(root / "kv.onnx")
    return compile_program(root / "p", onnx_path, kv_specs(fbs=2, ctx=16, prefill=4)), w


class Runner:
    """One program on one QID with a decode exec object."""

    def __init__(self, qpc: Path, qid: int) -> None:
        self.ctx = qaicrt.Context()
        self.queue = qaicrt.Queue(self.ctx, qid)
        self.program = qaicrt.Program(self.ctx, qid, qaicrt.Qpc(str(qpc)))
        assert self.program.load() == QStatus.SUCCESS and self.program.activate() == QStatus.SUCCESS
        self.exe = qaicrt.ExecObj(self.ctx, self.program)
        self.rng = np.random.default_rng(qid)

    def step(self, pos: int = 0) -> tuple[QStatus, np.ndarray, tuple[np.ndarray, ...]]:
        x = self.rng.standard_normal((2, 1, D)).astype(np.float32)
        p = np.array([[pos], [pos]], np.int64)
        b = np.array([[0], [1]], np.int64)
        y = np.zeros((2, D), np.float32)
        self.exe.setData([(0, x), (1, p), (2, b), (4, y)])
        self.queue.enqueue(self.exe)
        return self.exe.waitForCompletion(), y, (x, p, b)


def test_reset_fails_programs_on_that_qid_until_reloaded(kv: tuple[Path, np.ndarray]) -> None:
    qpc, w = kv
    a, b = Runner(qpc, 0), Runner(qpc, 1)
    get_machine().faults.inject("reset", qid=0, at=2)
    assert a.step(0)[0] == QStatus.SUCCESS
    assert a.step(1)[0] == QStatus.DEV_ERROR  # the reset hits this run
    status, _, _ = a.step(2)
    assert status == QStatus.DEV_ERROR and "load() it again" in a.exe.lastError
    info = qaicrt.Util().getResourceInfo(0)[1]
    assert info.nspFree == 16 and info.dramFree == 32 * 1024  # the reset freed the QID
    ref_b = KvReference(w, 2, 16)
    for pos in range(3):  # the other QID is unaffected, state intact
        status, y, inputs = b.step(pos)
        assert status == QStatus.SUCCESS
        np.testing.assert_allclose(y, ref_b.run(*inputs), rtol=1e-5, atol=1e-5)
    assert a.program.load() == QStatus.SUCCESS and a.program.activate() == QStatus.SUCCESS
    ref_a = KvReference(w, 2, 16)  # the state starts over after the reload
    status, y, inputs = a.step(0)
    assert status == QStatus.SUCCESS
    np.testing.assert_allclose(y, ref_a.run(*inputs), rtol=1e-5, atol=1e-5)
    assert qaicrt.Util().getResourceInfo(0)[1].nspFree == 16 - 4


def test_timeout_and_dev_error_hit_the_nth_run(kv: tuple[Path, np.ndarray]) -> None:
    qpc, _ = kv
    r = Runner(qpc, 2)
    get_machine().faults.inject("timeout", qid=2, at=1)
    get_machine().faults.inject("dev_error", qid=2, at=3)
    assert r.step()[0] == QStatus.TIMEDOUT
    assert r.step()[0] == QStatus.SUCCESS
    assert r.step()[0] == QStatus.DEV_ERROR
    assert r.step()[0] == QStatus.SUCCESS


def test_nomem_at_load(kv: tuple[Path, np.ndarray]) -> None:
    qpc, _ = kv
    get_machine().faults.inject("nomem", qid=3, at=1)
    ctx = qaicrt.Context()
    program = qaicrt.Program(ctx, 3, qaicrt.Qpc(str(qpc)))
    assert program.load() == QStatus.NOMEM
    assert "injected" in program.lastError
    assert program.load() == QStatus.SUCCESS


def test_faults_from_env_and_config_file(
    kv: tuple[Path, np.ndarray], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    qpc, _ = kv
    monkeypatch.setenv("QAIC_SIM_FAULTS", "dev_error@1:run=2")
    reset_machine()
    r = Runner(qpc, 1)
    assert [r.step()[0] for _ in range(3)] == [QStatus.SUCCESS, QStatus.DEV_ERROR, QStatus.SUCCESS]
    monkeypatch.delenv("QAIC_SIM_FAULTS")
    config = tmp_path / "sim.yaml"
    config.write_text("cards: [pro]\nfaults:\n  - {kind: timeout, qid: 0, run: 1}\n")
    monkeypatch.setenv("QAIC_SIM_CONFIG", str(config))
    reset_machine()
    r = Runner(qpc, 0)
    assert r.step()[0] == QStatus.TIMEDOUT


def test_reset_device_now_and_bad_fault_specs(kv: tuple[Path, np.ndarray]) -> None:
    qpc, _ = kv
    r = Runner(qpc, 0)
    get_machine().faults.reset_device(0)
    assert r.step()[0] == QStatus.DEV_ERROR
    with pytest.raises(QaicConfigError, match="kind must be one of"):
        get_machine().faults.inject("meltdown", qid=0)
    with pytest.raises(QaicConfigError, match="QID 9 does not exist"):
        get_machine().faults.inject("reset", qid=9)
    with pytest.raises(QaicConfigError, match=r"reset: QID 4 does not exist; devices: \[0, 1, 2, 3\]"):
        get_machine().faults.reset_device(4)
    with pytest.raises(QaicConfigError, match="unknown keys"):
        get_machine().faults.configure(({"kind": "reset", "qid": 0, "load": 1},))
