"""The simulated machine owns all simulator state; a program that cannot be timed is an error, never 0 s."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from sim_programs import compile_program, kv_specs, write_kv_model

from qaic_core.controls import FaultControl, TraceControl
from qaic_core.errors import QaicConfigError
from qaic_core.manager import get_plugin_manager
from qaic_core.types import Specialization
from qaic_sim import qaicrt, qpcfile
from qaic_sim.costing import TimingModelError
from qaic_sim.machine import SimMachine, get_machine, reset_machine
from qaic_sim.qaicrt import QStatus


def write_untimeable_model(path: Path) -> Path:
    """y = reshape(x, shape) @ W: it runs, but the MatMul's input has no static shape before a run."""
    w = np.eye(4, dtype=np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Reshape", ["x", "shape"], ["r"]),
            helper.make_node("MatMul", ["r", "W"], ["y"], name="proj"),
        ],
        "untimeable",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [8]),
            helper.make_tensor_value_info("shape", TensorProto.INT64, [2]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        [numpy_helper.from_array(w, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def _compile_untimeable(root: Path) -> Path:
    return compile_program(
        root,
        write_untimeable_model(root.parent / f"{root.name}.onnx"),
        [Specialization("default", {})],
        flags=(),
    )


def _run_untimeable(qpc: Path) -> tuple[qaicrt.ExecObj, np.ndarray]:
    ctx = qaicrt.Context()
    program = qaicrt.Program(ctx, 0, qaicrt.Qpc(str(qpc)))
    assert program.load() == QStatus.SUCCESS and program.activate() == QStatus.SUCCESS
    exe = qaicrt.ExecObj(ctx, program)
    y = np.zeros((2, 4), np.float32)
    exe.setData([(0, np.arange(8, dtype=np.float32)), (1, np.array([2, 4], np.int64)), (2, y)])
    qaicrt.Queue(ctx, 0).enqueue(exe)
    exe.waitForCompletion()
    return exe, y


def test_untimeable_program_fails_to_compile_naming_node_and_fix(tmp_path: Path) -> None:
    with pytest.raises(TimingModelError) as err:
        _compile_untimeable(tmp_path / "p")
    message = str(err.value)
    assert "specialization 'default'" in message
    assert "MatMul node 'proj'" in message and "no static shape" in message
    assert "QAIC_SIM_TIMING=0" in message
    assert not (tmp_path / "p" / "qpc" / "programqpc.bin").exists()


def test_timing_off_warns_once_and_runs_report_zero(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("QAIC_SIM_TIMING", "0")
    reset_machine()
    qpc = _compile_untimeable(tmp_path / "p")
    manifest, _ = qpcfile.read_manifest(qpc)
    assert manifest.specs[0].cost is None
    with caplog.at_level(logging.WARNING, logger="qaic.sim"):
        for _ in range(3):
            exe, y = _run_untimeable(qpc)
            assert exe.waitForCompletion() == QStatus.SUCCESS and exe.lastDeviceTimeS == 0.0
            np.testing.assert_array_equal(y, np.arange(8, dtype=np.float32).reshape(2, 4))
    warnings = [r for r in caplog.records if "QAIC_SIM_TIMING=0" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    _, perf = qaicrt.Util().getPerformanceInfo(0)
    assert perf.numRuns == 3 and perf.deviceTimeS == 0.0


def test_program_compiled_without_costs_fails_its_runs_when_timing_is_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QAIC_SIM_TIMING", "0")
    reset_machine()
    qpc = _compile_untimeable(tmp_path / "p")
    monkeypatch.delenv("QAIC_SIM_TIMING")
    reset_machine()
    exe, y = _run_untimeable(qpc)
    assert exe.waitForCompletion() == QStatus.ERROR
    assert "cannot model the device time" in exe.lastError and "MatMul node 'proj'" in exe.lastError
    assert not y.any()  # the run failed before executing


def test_compiled_costs_are_stored_and_read_back(tmp_path: Path) -> None:
    onnx_path, _ = write_kv_model(tmp_path / "kv.onnx")
    qpc = compile_program(tmp_path / "p", onnx_path, kv_specs())
    raw = json.loads(qpcfile.read_member(qpc, qpcfile.MANIFEST))
    costs = [s["cost"] for s in raw["specializations"]]
    assert [c["tokens"] for c in costs] == [4, 2]  # Prefill (1 x 4 rows), Decode (2 x 1)
    image = qaicrt.Qpc(str(qpc)).image
    assert image.cost(1).flops == costs[1]["flops"] > 0


@pytest.mark.parametrize("pace", [("QAIC_SIM_PACE", "1"), ("QAIC_SIM_PACE_AS", "qwen2.5-0.5b")])
def test_pacing_with_timing_off_is_refused(pace: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QAIC_SIM_TIMING", "0")
    monkeypatch.setenv(*pace)
    with pytest.raises(QaicConfigError, match="turn pacing off or timing on"):
        reset_machine()
    monkeypatch.delenv(pace[0])  # the fixture's reset after the test needs a valid environment


def test_reset_machine_gives_fresh_topology_faults_trace_and_images(tmp_path: Path) -> None:
    onnx_path, _ = write_kv_model(tmp_path / "kv.onnx")
    qpc = compile_program(tmp_path / "p", onnx_path, kv_specs())
    old = get_machine()
    ctx = qaicrt.Context()
    program = qaicrt.Program(ctx, 1, qaicrt.Qpc(str(qpc)))
    assert program.load() == QStatus.SUCCESS and program.activate() == QStatus.SUCCESS
    old.faults.inject("dev_error", qid=2, at=5)
    old.trace.start(tmp_path / "trace")
    assert old.topology.devices[1].nsp_used == 4 and old.faults.armed() and old.trace.active
    assert len(old.images) == 1 and ctx.machine is old and program.machine is old

    new = reset_machine()
    assert new is get_machine() and new is not old
    assert (tmp_path / "trace" / "trace.json").is_file()  # the old machine's trace was written out
    assert not new.trace.active and not old.trace.active
    assert new.faults.armed() == [] and len(new.images) == 0
    assert all(d.nsp_used == 0 and d.dram_used == 0 and d.runs == 0 for d in new.topology.devices)
    assert qaicrt.Util().getResourceInfo(1)[1].nspFree == 16
    assert qaicrt.Context().machine is new and ctx.machine is old  # earlier objects keep their machine


def test_reset_machine_installs_a_given_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    from qaic_sim.config import load_config

    machine = SimMachine(load_config({"QAIC_SIM_TOPOLOGY": "standard:2"}))
    assert reset_machine(machine) is machine
    assert qaicrt.Util().getDeviceIds()[1] == [0, 1]


def test_backend_controls_follow_the_current_machine(tmp_path: Path) -> None:
    backend = get_plugin_manager(strict=True).select_device_backend("sim")
    assert isinstance(backend.trace, TraceControl) and isinstance(backend.faults, FaultControl)
    backend.faults.inject("timeout", qid=3, at=2)
    assert get_machine().faults.armed()[0].qid == 3
    backend.faults.clear()
    assert get_machine().faults.armed() == []
    reset_machine()
    backend.trace.start(tmp_path / "t")
    assert backend.trace.active and get_machine().trace.active
    assert backend.trace.stop() == tmp_path / "t" / "trace.json"
    assert not backend.trace.active and backend.trace.stop() is None
