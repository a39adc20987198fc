"""Conformance tests every device backend must pass (see :mod:`qaic_core.testing`).

The tests drive the runtime exactly as QEfficient's ``QAICInferenceSession`` does, so a backend
that passes them can stand in for the real ``qaicrt``. The installed model loaders and session
factories are checked too: unique names, descriptions, known kinds, and every available session
factory's session runs a program on the backend under test.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from qaic_core import qpc as layout
from qaic_core import runtime as contract
from qaic_core.controls import FAULT_KINDS, FaultControl, TraceControl
from qaic_core.descriptors import CAPABILITIES, LOADER_KINDS, DeviceBackend
from qaic_core.manager import get_plugin_manager
from qaic_core.runtime import AicApiModule, QaicrtModule, missing_members
from qaic_core.session import DeviceSession, SessionRequest
from qaic_core.testing.models import compile_accumulator
from qaic_core.types import BUFFER_DTYPES, BufferType, QStatus


def assert_follows(obj: object, protocol: type) -> None:
    """Fail naming each member of ``protocol`` (a :mod:`qaic_core.runtime` Protocol) that ``obj`` lacks."""
    missing = missing_members(obj, protocol)
    name = getattr(obj, "__name__", None)  # a module or class; else the instance's class
    what = name if isinstance(name, str) else f"a {type(obj).__name__}"
    assert not missing, f"{protocol.__name__}: {what} lacks {', '.join(missing)}"


def test_backend_is_available(backend: DeviceBackend) -> None:
    assert backend.is_available()
    assert backend.capabilities <= CAPABILITIES, backend.capabilities - CAPABILITIES


def test_trace_and_fault_controls_match_the_capabilities(backend: DeviceBackend) -> None:
    # Callers use backend.trace / backend.faults when the capability is claimed, so the two must agree.
    assert ("traces" in backend.capabilities) == (backend.trace is not None), (
        "a backend claims 'traces' exactly when DeviceBackend.trace is set"
    )
    assert ("faults" in backend.capabilities) == (backend.faults is not None), (
        "a backend claims 'faults' exactly when DeviceBackend.faults is set"
    )
    assert backend.trace is None or isinstance(backend.trace, TraceControl)
    assert backend.faults is None or isinstance(backend.faults, FaultControl)


def test_runtime_has_qaicrt_names(qaicrt: QaicrtModule, aicapi: AicApiModule) -> None:
    assert_follows(qaicrt, QaicrtModule)
    assert_follows(aicapi, AicApiModule)


def test_runtime_objects_follow_the_contract(qaicrt: QaicrtModule, aicapi: AicApiModule) -> None:
    # What the runtime makes without a program; the session objects are checked below.
    assert_follows(qaicrt.QStatus, contract.StatusCodes)
    assert_follows(qaicrt.QLogLevel, contract.LogLevels)
    assert_follows(qaicrt.Util(), contract.Util)
    assert_follows(qaicrt.QAicProgramProperties(), contract.QAicProgramProperties)
    assert_follows(qaicrt.QBuffer(bytes(4)), contract.QBuffer)
    assert_follows(aicapi.IoDesc(), contract.IoDesc)


def test_status_codes_match_the_runtime(qaicrt: QaicrtModule) -> None:
    # The real runtime spells its codes QS_SUCCESS, QS_NOMEM, ... (as QEfficient compares them).
    for status in QStatus:
        assert int(getattr(qaicrt.QStatus, f"QS_{status.name}")) == status.value, status


def test_devices_are_listed_with_resources(qaicrt: QaicrtModule) -> None:
    util = qaicrt.Util()
    status, ids = util.getDeviceIds()
    assert status == qaicrt.QStatus.QS_SUCCESS
    assert len(ids) >= 1
    status, info = util.getResourceInfo(ids[0])
    assert status == qaicrt.QStatus.QS_SUCCESS
    assert info is not None
    assert_follows(info, contract.QResourceInfo)
    assert info.nspTotal >= 1 and 0 <= info.nspFree <= info.nspTotal
    assert info.dramTotal > 0 and 0 <= info.dramFree <= info.dramTotal


@pytest.fixture(scope="module")
def accumulator_qpc(backend: DeviceBackend, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if "compile" not in backend.capabilities or backend.compiler is None:
        pytest.skip(f"backend {backend.name!r} does not claim compile")
    root = compile_accumulator(backend.compiler, tmp_path_factory.mktemp("accumulator"))
    assert layout.qpc_exists(root)
    return root / "qpc"


class _Session:
    """The minimal QEfficient-style call sequence, written against the runtime names only."""

    def __init__(self, qaicrt: QaicrtModule, aicapi: AicApiModule, qpc_dir: Path) -> None:
        self.rt = qaicrt
        status, ids = qaicrt.Util().getDeviceIds()
        self.device = ids[0]
        self.ctx = qaicrt.Context(qaicrt.QIDList([self.device]))
        self.queue = qaicrt.Queue(self.ctx, self.device)
        self.qpc = qaicrt.Qpc(str(qpc_dir))
        self.iodesc = iodesc = aicapi.IoDesc()
        status, data = self.qpc.getIoDescriptor()
        assert status == qaicrt.QStatus.QS_SUCCESS
        iodesc.ParseFromString(bytes(data))
        self.bindings = list(iodesc.selected_set.bindings)
        self.allowed_shapes = [
            [(BUFFER_DTYPES[BufferType(s.type)].itemsize, list(s.dims)) for s in shape.shapes]
            for shape in iodesc.allowed_shapes
        ]
        props = qaicrt.QAicProgramProperties()
        props.dataPathTimeoutMs = 60000
        self.program = qaicrt.Program(self.ctx, self.device, self.qpc, props)
        assert self.program.load() == qaicrt.QStatus.QS_SUCCESS
        assert self.program.activate() == qaicrt.QStatus.QS_SUCCESS
        self.exe = qaicrt.ExecObj(self.ctx, self.program)

    def run(
        self, arrays: dict[str, Any], out_shapes: dict[str, list[int]]
    ) -> tuple[int, dict[str, np.ndarray]]:
        buffers: list[contract.QBuffer] = []
        dims: list[tuple[int, list[int]]] = []
        for b in self.bindings:
            dtype = BUFFER_DTYPES[BufferType(b.type)]
            if b.dir == 0:
                arr = np.ascontiguousarray(arrays[b.name], dtype=dtype)
                buffers.append(self.rt.QBuffer(arr.tobytes()))
                dims.append((dtype.itemsize, list(arr.shape)))
            else:
                shape = out_shapes[b.name]
                size = int(np.prod(shape)) * dtype.itemsize
                buffers.append(self.rt.QBuffer(bytes(size)))
                dims.append((dtype.itemsize, shape))
        self.exe.setData(buffers, self.rt.BufferDimensionsVecRef(dims))
        self.queue.enqueue(self.exe)
        status = self.exe.waitForCompletion()
        if status != self.rt.QStatus.QS_SUCCESS:
            return int(status), {}
        status, outs = self.exe.getData()
        result: dict[str, np.ndarray] = {}
        for b, buf, (_, shape) in zip(self.bindings, outs, dims, strict=True):
            if b.dir == 1 and int(np.prod(shape)) > 0:
                result[b.name] = np.frombuffer(bytes(buf), dtype=BUFFER_DTYPES[BufferType(b.type)]).reshape(
                    shape
                )
        return int(status), result

    def close(self) -> None:
        self.program.deactivate()


@pytest.mark.requires("compile")
def test_session_objects_follow_the_contract(
    qaicrt: QaicrtModule, aicapi: AicApiModule, accumulator_qpc: Path
) -> None:
    s = _Session(qaicrt, aicapi, accumulator_qpc)
    try:
        for obj, protocol in [
            (s.ctx, contract.Context),
            (s.queue, contract.Queue),
            (s.qpc, contract.Qpc),
            (s.program, contract.Program),
            (s.exe, contract.ExecObj),
            (s.iodesc.selected_set, contract.IoSet),
            (s.bindings[0], contract.IoBinding),
            (s.iodesc.allowed_shapes[0], contract.AllowedShapes),
            (s.iodesc.allowed_shapes[0].shapes[0], contract.Shape),
        ]:
            assert_follows(obj, protocol)
    finally:
        s.close()


@pytest.mark.requires("compile", "retained_state")
def test_retained_state_round_trips(
    qaicrt: QaicrtModule, aicapi: AicApiModule, accumulator_qpc: Path
) -> None:
    s = _Session(qaicrt, aicapi, accumulator_qpc)
    try:
        assert len(s.allowed_shapes) == 2
        one = np.ones((1, 4), np.float32)
        zero_state = np.zeros((2, 4), np.float32)
        status, out = s.run(
            {"x": one, "batch_index": np.array([[1]]), "state": zero_state},
            {"y": [1, 4], "state_RetainedState": [0]},
        )
        assert status == 0
        np.testing.assert_array_equal(out["y"], one)
        # A zero-size state buffer keeps what the device retained from the last run.
        status, out = s.run(
            {"x": 2 * one, "batch_index": np.array([[1]]), "state": np.zeros((0,), np.float32)},
            {"y": [1, 4], "state_RetainedState": [0]},
        )
        assert status == 0
        np.testing.assert_array_equal(out["y"], 3 * one)
        status, out = s.run(
            {
                "x": np.ones((2, 4), np.float32),
                "batch_index": np.array([[0], [1]]),
                "state": np.zeros((0,), np.float32),
            },
            {"y": [2, 4], "state_RetainedState": [0]},
        )
        assert status == 0
        np.testing.assert_array_equal(out["y"], np.array([[1] * 4, [4] * 4], np.float32))
    finally:
        s.close()


@pytest.mark.requires("compile")
def test_unmatched_shapes_fail_the_wait(
    qaicrt: QaicrtModule, aicapi: AicApiModule, accumulator_qpc: Path
) -> None:
    s = _Session(qaicrt, aicapi, accumulator_qpc)
    try:
        status, _ = s.run(
            {
                "x": np.ones((3, 4), np.float32),
                "batch_index": np.array([[0], [1], [0]]),
                "state": np.zeros((2, 4), np.float32),
            },
            {"y": [3, 4], "state_RetainedState": [0]},
        )
        assert status != 0
    finally:
        s.close()


def _ok(qaicrt: QaicrtModule) -> int:
    """The runtime's success code, ``QStatus.QS_SUCCESS``."""
    return int(qaicrt.QStatus.QS_SUCCESS)


@pytest.mark.requires("compile")
def test_iodesc_bindings_are_consistent(
    qaicrt: QaicrtModule, aicapi: AicApiModule, accumulator_qpc: Path
) -> None:
    iodesc = aicapi.IoDesc()
    status, data = qaicrt.Qpc(str(accumulator_qpc)).getIoDescriptor()
    assert int(status) == _ok(qaicrt)
    iodesc.ParseFromString(bytes(data))
    bindings = list(iodesc.selected_set.bindings)
    assert [b.index for b in bindings] == list(range(len(bindings)))
    assert {b.name: b.dir for b in bindings} == {
        "x": 0,
        "batch_index": 0,
        "state": 0,
        "y": 1,
        "state_RetainedState": 1,
    }
    for b in bindings:
        assert b.size >= int(np.prod(list(b.dims))) * BUFFER_DTYPES[BufferType(b.type)].itemsize
    for shape in iodesc.allowed_shapes:
        assert [s.type for s in shape.shapes] == [b.type for b in bindings]


@pytest.mark.requires("compile", "retained_state")
def test_zero_copy_setdata_fills_outputs_in_place(
    qaicrt: QaicrtModule, aicapi: AicApiModule, accumulator_qpc: Path
) -> None:
    s = _Session(qaicrt, aicapi, accumulator_qpc)
    try:
        idx = {b.name: b.index for b in s.bindings}
        x = np.full((2, 4), 2.0, np.float32)
        y = np.zeros((2, 4), np.float32)
        pairs = [
            (idx["x"], x),
            (idx["batch_index"], np.array([[0], [1]])),
            (idx["state"], np.ones((2, 4), np.float32)),
        ]
        assert int(s.exe.setData([*pairs, (idx["y"], y)])) == _ok(qaicrt)
        s.queue.enqueue(s.exe)
        assert int(s.exe.waitForCompletion()) == _ok(qaicrt)
        np.testing.assert_array_equal(y, np.full((2, 4), 3.0, np.float32))
    finally:
        s.close()


@pytest.mark.requires("compile", "retained_state", "slicing")
def test_slices_write_one_slot_of_retained_state(
    qaicrt: QaicrtModule, aicapi: AicApiModule, accumulator_qpc: Path
) -> None:
    s = _Session(qaicrt, aicapi, accumulator_qpc)
    try:
        idx = {b.name: b.index for b in s.bindings}
        spec = {
            "BufferSpecs": [
                {"Name": "state", "ElemSize": 4, "DimSpecs": [{"start": "batch_index"}, {"start": 0}]}
            ]
        }
        status, handle = s.program.createSlicingSpecHandle(json.dumps(spec))
        assert int(status) == _ok(qaicrt)
        slot = np.full((1, 4), 5.0, np.float32)
        y = np.zeros((1, 4), np.float32)
        pairs = [
            (idx["x"], np.ones((1, 4), np.float32)),
            (idx["batch_index"], np.array([[1]])),
            (idx["state"], slot),
            (idx["y"], y),
        ]
        status, _ = s.exe.setDataWithSlices(pairs, handle, [("batch_index", 1)])
        assert int(status) == _ok(qaicrt)
        s.queue.enqueue(s.exe)
        assert int(s.exe.waitForCompletion()) == _ok(qaicrt)
        np.testing.assert_array_equal(y, np.full((1, 4), 6.0, np.float32))
    finally:
        s.close()


@pytest.mark.requires("compile")
def test_resources_follow_activate_and_unload(qaicrt: QaicrtModule, accumulator_qpc: Path) -> None:
    util = qaicrt.Util()
    _, ids = util.getDeviceIds()
    device = ids[0]
    ctx = qaicrt.Context(qaicrt.QIDList([device]))
    _, before = util.getResourceInfo(device)
    assert before is not None
    program = qaicrt.Program(ctx, device, qaicrt.Qpc(str(accumulator_qpc)), qaicrt.QAicProgramProperties())
    assert int(program.load()) == _ok(qaicrt)
    assert int(program.activate()) == _ok(qaicrt)
    _, active = util.getResourceInfo(device)
    assert active is not None
    assert active.nspFree <= before.nspFree - 1  # compiled with -aic-num-cores=1
    program.deactivate()
    program.unload()
    _, after = util.getResourceInfo(device)
    assert after is not None
    assert after.nspFree == before.nspFree and after.dramFree == before.dramFree


@pytest.mark.requires("compile", "multi_device")
def test_program_spans_two_devices(
    qaicrt: QaicrtModule, aicapi: AicApiModule, backend: DeviceBackend, tmp_path: Path
) -> None:
    _, ids = qaicrt.Util().getDeviceIds()
    if len(ids) < 2:
        pytest.skip("needs two devices")
    (tmp_path / "mdp_ts_2.json").write_text(json.dumps(layout.mdp_partition(ids[:2], 1)))
    assert backend.compiler is not None
    compile_accumulator(
        backend.compiler,
        tmp_path,
        batch_sizes=(1,),
        extra_flags=[f"-mdp-load-partition-config={tmp_path / 'mdp_ts_2.json'}"],
    )
    ctx = qaicrt.Context(qaicrt.QIDList(ids[:2]))
    props = qaicrt.QAicProgramProperties()
    props.devMapping = ":".join(map(str, ids[:2]))
    qpc = qaicrt.Qpc(str(tmp_path / "qpc"))
    status, data = qpc.getIoDescriptor()
    assert int(status) == _ok(qaicrt)
    iodesc = aicapi.IoDesc()
    iodesc.ParseFromString(bytes(data))
    idx = {b.name: b.index for b in iodesc.selected_set.bindings}
    program = qaicrt.Program(ctx, None, qpc, props)
    assert int(program.load()) == _ok(qaicrt)
    assert int(program.activate()) == _ok(qaicrt)
    exe = qaicrt.ExecObj(ctx, program)
    y = np.zeros((1, 4), np.float32)
    pairs = [
        (idx["x"], np.ones((1, 4), np.float32)),
        (idx["batch_index"], np.array([[0]])),
        (idx["state"], np.zeros((2, 4), np.float32)),
        (idx["y"], y),
    ]
    assert int(exe.setData(pairs)) == _ok(qaicrt)
    qaicrt.Queue(ctx, ids[0]).enqueue(exe)
    assert int(exe.waitForCompletion()) == _ok(qaicrt)
    np.testing.assert_array_equal(y, np.ones((1, 4), np.float32))
    program.deactivate()
    program.unload()


def _run_once(s: _Session) -> int:
    """One batch-1 run of the accumulator with its state supplied; its status."""
    status, _ = s.run(
        {
            "x": np.ones((1, 4), np.float32),
            "batch_index": np.array([[0]]),
            "state": np.zeros((2, 4), np.float32),
        },
        {"y": [1, 4], "state_RetainedState": [0]},
    )
    return status


@pytest.mark.requires("compile", "traces")
def test_trace_control_records_runs(
    backend: DeviceBackend, qaicrt: QaicrtModule, aicapi: AicApiModule, accumulator_qpc: Path, tmp_path: Path
) -> None:
    control = backend.trace
    assert control is not None
    s = _Session(qaicrt, aicapi, accumulator_qpc)
    try:
        control.start(tmp_path / "trace")
        assert control.active
        assert _run_once(s) == _ok(qaicrt)
        written = control.stop()
    finally:
        s.close()
    assert not control.active
    assert written is not None and written.is_file()
    assert control.stop() is None  # nothing left to stop


@pytest.mark.requires("compile", "faults")
def test_fault_control_fails_runs_and_loads(
    backend: DeviceBackend, qaicrt: QaicrtModule, aicapi: AicApiModule, accumulator_qpc: Path
) -> None:
    faults = backend.faults
    assert faults is not None
    s = _Session(qaicrt, aicapi, accumulator_qpc)
    ok = _ok(qaicrt)
    try:
        assert {"dev_error", "timeout", "reset", "nomem"} == FAULT_KINDS
        faults.inject("dev_error", s.device, 2)
        assert [_run_once(s) for _ in range(3)] == [ok, int(qaicrt.QStatus.QS_DEV_ERROR), ok]
        faults.inject("timeout", s.device, 1)
        assert _run_once(s) == int(qaicrt.QStatus.QS_TIMEDOUT)
        faults.reset_device(s.device)
        assert _run_once(s) != ok  # the program lost the device until it is loaded again
        assert int(s.program.load()) == ok and int(s.program.activate()) == ok
        assert _run_once(s) == ok
        faults.inject("nomem", s.device, 1)
        other = qaicrt.Program(s.ctx, s.device, s.qpc, qaicrt.QAicProgramProperties())
        assert int(other.load()) == int(qaicrt.QStatus.QS_NOMEM)
        assert int(other.load()) == ok
        other.unload()
        faults.inject("dev_error", s.device, 1)
        faults.clear()
        assert _run_once(s) == ok
    finally:
        faults.clear()
        s.close()


# -- model loaders and session factories (hooks qaic_model_loaders / qaic_session_factories) ----------
def test_model_loaders_are_named_described_and_of_known_kinds() -> None:
    loaders = get_plugin_manager().model_loaders()  # two loaders of one name raise, naming both
    if not loaders:
        pytest.skip("no model loader is installed (pip install qaic-aot or qaic-pyt)")
    for name, loader in loaders.items():
        assert name == loader.name and name.strip() == name, f"loader {name!r}: a name without spaces"
        assert loader.package, f"model loader {name!r} names no package"
        assert loader.description.strip(), f"model loader {name!r} ({loader.package}) has no description"
        assert loader.kind in LOADER_KINDS, (
            f"model loader {name!r} ({loader.package}) loads {loader.kind!r}, not one of {sorted(LOADER_KINDS)}"
        )
        assert callable(loader.load) and callable(loader.applies), name


def test_session_factories_are_named_and_described() -> None:
    factories = get_plugin_manager().session_factories()  # two factories of one name raise, naming both
    if not factories:
        pytest.skip("no session factory is installed (pip install qaic-aot)")
    for name, factory in factories.items():
        assert name == factory.name and name.strip() == name, f"factory {name!r}: a name without spaces"
        assert factory.package, f"session factory {name!r} names no package"
        assert factory.description.strip(), f"session factory {name!r} ({factory.package}) has no description"
        assert callable(factory.open), name


@pytest.mark.requires("compile", "retained_state")
def test_session_factories_run_a_program(backend: DeviceBackend, accumulator_qpc: Path) -> None:
    """Each available factory's session runs the accumulator on this backend: plain, submitted and prepared."""
    factories = [f for f in get_plugin_manager().session_factories().values() if f.is_available()]
    if not factories:
        pytest.skip("no session factory is available (pip install qaic-aot)")
    one = np.ones((1, 4), np.float32)
    slot = np.array([[1]], np.int64)
    for factory in factories:
        session = factory.open(SessionRequest(program=accumulator_qpc, backend=backend))
        try:
            missing = missing_members(session, DeviceSession)
            assert not missing, f"session factory {factory.name!r}: its session lacks {', '.join(missing)}"
            assert session.device_backend.name == backend.name, factory.name
            assert session.is_active and session.num_exec_objects >= 1, factory.name
            session.skip_buffers(["state", "state_RetainedState"])  # the device keeps the state
            np.testing.assert_array_equal(session.run({"x": one, "batch_index": slot})["y"], one)
            out = session.submit({"x": 2 * one, "batch_index": slot}, 0).wait()
            np.testing.assert_array_equal(out["y"], 3 * one)
            prepared = session.prepare({"x": np.zeros((1, 4), np.float32), "batch_index": slot}, 0)
            prepared.array("x")[:] = 4  # written after preparing, before the run starts
            np.testing.assert_array_equal(prepared.submit().wait()["y"], 7 * one)
        finally:
            session.deactivate()
