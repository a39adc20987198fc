"""Device resources: DDR at load (NOMEM), NSP cores at activate, several programs and queues."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
from sim_programs import D, KvReference, compile_program, kv_specs, write_kv_model, write_matmul_model

from qaic_core.errors import QaicRuntimeError
from qaic_core.types import Specialization
from qaic_sim import qaicrt, qpcfile
from qaic_sim.machine import reset_machine
from qaic_sim.qaicrt import QStatus

GB = 2**30


@pytest.fixture(scope="module")
def big_kv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A program whose retained KV alone needs 17.2 GB (never allocated unless it runs)."""
    root = tmp_path_factory.mktemp("big")
    onnx_path, _ = write_kv_model(root / "kv.onnx")
    return compile_program(root / "p", onnx_path, kv_specs(fbs=128, ctx=2**22, prefill=4))


def _free_mb(qid: int) -> int:
    status, info = qaicrt.Util().getResourceInfo(qid)
    assert status == QStatus.SUCCESS
    return int(info.dramFree)


def test_load_fails_with_nomem_when_ddr_is_short(
    big_kv: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    manifest, _ = qpcfile.read_manifest(big_kv)
    assert 16 * GB < manifest.dram_bytes < 32 * GB
    monkeypatch.setenv("QAIC_SIM_TOPOLOGY", "standard")
    reset_machine()
    ctx = qaicrt.Context()
    program = qaicrt.Program(ctx, 0, qaicrt.Qpc(str(big_kv)))
    with caplog.at_level(logging.ERROR):
        assert program.load() == QStatus.NOMEM
    assert "not enough device memory on QID 0" in program.lastError
    assert _free_mb(0) == 16 * 1024


def test_ddr_is_accounted_and_freed_on_unload(big_kv: Path) -> None:
    manifest, _ = qpcfile.read_manifest(big_kv)
    ctx = qaicrt.Context()
    first = qaicrt.Program(ctx, 0, qaicrt.Qpc(str(big_kv)))
    assert first.load() == QStatus.SUCCESS
    assert _free_mb(0) == (32 * GB - manifest.dram_bytes) // 2**20
    second = qaicrt.Program(ctx, 0, qaicrt.Qpc(str(big_kv)))
    assert second.load() == QStatus.NOMEM  # two copies do not fit one SoC
    assert qaicrt.Program(ctx, 1, qaicrt.Qpc(str(big_kv))).load() == QStatus.SUCCESS  # another QID is free
    assert first.unload() == QStatus.SUCCESS
    assert _free_mb(0) == 32 * 1024
    assert second.load() == QStatus.SUCCESS


def test_program_over_several_devices_splits_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QAIC_SIM_TOPOLOGY", "standard:2")
    reset_machine()
    onnx_path, _w = write_kv_model(tmp_path / "kv.onnx")
    qpc = compile_program(tmp_path / "p", onnx_path, kv_specs(fbs=128, ctx=2**22, prefill=4), mdp_devices=2)
    manifest, _ = qpcfile.read_manifest(qpc)
    assert manifest.num_devices == 2
    ctx = qaicrt.Context(qaicrt.QIDList([0, 1]))
    single = qaicrt.Program(ctx, 0, qaicrt.Qpc(str(qpc)))
    assert single.load() == QStatus.INVAL
    assert "compiled for 2 device(s)" in single.lastError
    props = qaicrt.QAicProgramProperties()
    props.devMapping = "0:1"
    program = qaicrt.Program(ctx, None, qaicrt.Qpc(str(qpc)), props)
    assert program.load() == QStatus.SUCCESS  # 17 GB over two 16 GB SoCs
    half = -(-manifest.dram_bytes // 2)
    assert _free_mb(0) == _free_mb(1) == (16 * GB - half) // 2**20
    assert program.activate() == QStatus.SUCCESS
    _status, info = qaicrt.Util().getResourceInfo(1)
    assert info.nspFree == 16 - manifest.num_cores
    program.unload()
    assert _free_mb(0) == _free_mb(1) == 16 * 1024


def test_nsp_oversubscription_fails_and_deactivate_frees(tmp_path: Path) -> None:
    onnx_path, _ = write_matmul_model(tmp_path / "mm.onnx", width=8)
    qpc = compile_program(
        tmp_path / "p", onnx_path, [Specialization("b", {"batch_size": 1})], flags=(), num_cores=10
    )
    ctx = qaicrt.Context()
    a = qaicrt.Program(ctx, 0, qaicrt.Qpc(str(qpc)))
    b = qaicrt.Program(ctx, 0, qaicrt.Qpc(str(qpc)))
    assert a.load() == QStatus.SUCCESS and b.load() == QStatus.SUCCESS  # loading takes DDR only
    assert a.activate() == QStatus.SUCCESS
    assert qaicrt.Util().getResourceInfo(0)[1].nspFree == 6
    assert b.activate() == QStatus.NOSPC
    assert "-aic-num-cores=10 but 6 of 16 are free" in b.lastError
    assert a.deactivate() == QStatus.SUCCESS
    assert qaicrt.Util().getResourceInfo(0)[1].nspFree == 16
    assert b.activate() == QStatus.SUCCESS
    b.unload()
    a.unload()
    assert qaicrt.Util().getResourceInfo(0)[1].nspFree == 16


def test_dropped_program_gives_resources_back(tmp_path: Path) -> None:
    onnx_path, _ = write_matmul_model(tmp_path / "mm.onnx", width=8)
    qpc = compile_program(
        tmp_path / "p", onnx_path, [Specialization("b", {"batch_size": 1})], flags=(), num_cores=16
    )
    ctx = qaicrt.Context()
    program = qaicrt.Program(ctx, 0, qaicrt.Qpc(str(qpc)))
    program.load()
    program.activate()
    assert qaicrt.Util().getResourceInfo(0)[1].nspFree == 0
    del program
    import gc

    gc.collect()
    assert qaicrt.Util().getResourceInfo(0)[1].nspFree == 16


def test_programs_and_queues_run_side_by_side(tmp_path: Path) -> None:
    onnx_path, w = write_kv_model(tmp_path / "kv.onnx")
    qpc = compile_program(tmp_path / "p", onnx_path, kv_specs(fbs=2, ctx=16, prefill=4))
    ctx = qaicrt.Context()
    props = qaicrt.QAicQueueProperties()
    props.numThreadsPerQueue = 2
    queues = [qaicrt.Queue(ctx, 0), qaicrt.Queue(ctx, 1)]
    assert queues[0].initProperties(props) == QStatus.SUCCESS
    programs = [
        qaicrt.Program(ctx, 0, qaicrt.Qpc(str(qpc))),
        qaicrt.Program(ctx, 0, qaicrt.Qpc(str(qpc))),
        qaicrt.Program(ctx, 1, qaicrt.Qpc(str(qpc))),
    ]
    for p in programs:
        assert p.load() == QStatus.SUCCESS and p.activate() == QStatus.SUCCESS
    refs = [KvReference(w, 2, 16) for _ in programs]
    rng = np.random.default_rng(11)
    exes = [qaicrt.ExecObj(ctx, p) for p in programs]
    for step in range(4):
        ys, inputs = [], []
        for i, exe in enumerate(exes):
            x = rng.standard_normal((2, 1, D)).astype(np.float32)
            pos = np.array([[step], [step + i]], np.int64)
            bidx = np.array([[0], [1]], np.int64)
            y = np.zeros((2, D), np.float32)
            exe.setData([(0, x), (1, pos), (2, bidx), (4, y)])
            queues[0 if i < 2 else 1].enqueue(exe)
            ys.append(y)
            inputs.append((x, pos, bidx))
        for i, exe in enumerate(exes):
            assert exe.waitForCompletion() == QStatus.SUCCESS
            # Each program instance keeps its own retained state.
            np.testing.assert_allclose(ys[i], refs[i].run(*inputs[i]), rtol=1e-5, atol=1e-5)
    status, perf = qaicrt.Util().getPerformanceInfo(0)
    assert status == QStatus.SUCCESS and perf.numRuns == 8
    for p in programs:
        p.unload()


def test_unknown_devices_are_errors(tmp_path: Path) -> None:
    with pytest.raises(QaicRuntimeError, match="do not exist"):
        qaicrt.Context(qaicrt.QIDList([7]))
    with pytest.raises(
        QaicRuntimeError, match=r"queue device 4 does not exist; visible devices: \[0, 1, 2, 3\]"
    ):
        qaicrt.Queue(qaicrt.Context(), 4)
    assert qaicrt.Util().getResourceInfo(9)[0] == QStatus.NODEV
    onnx_path, _ = write_matmul_model(tmp_path / "mm.onnx", width=8)
    qpc = compile_program(tmp_path / "p", onnx_path, [Specialization("b", {"batch_size": 1})], flags=())
    ctx = qaicrt.Context(qaicrt.QIDList([1]))
    program = qaicrt.Program(ctx, 0, qaicrt.Qpc(str(qpc)))
    assert program.load() == QStatus.NODEV
    assert "not in this context" in program.lastError
