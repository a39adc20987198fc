"""Conformance tests every device backend must pass (see :mod:`qaic_core.testing`).

The tests drive the runtime exactly as QEfficient's ``QAICInferenceSession`` does, so a backend
that passes them can stand in for the real ``qaicrt``.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from qaic_core import qpc as layout
from qaic_core.descriptors import CAPABILITIES, DeviceBackend
from qaic_core.testing.models import write_accumulator
from qaic_core.types import BUFFER_DTYPES, BufferType, QStatus, Specialization

RUNTIME_NAMES = [
    "QIDList",
    "Context",
    "Queue",
    "Qpc",
    "QBuffer",
    "BufferDimensionsVecRef",
    "QAicProgramProperties",
    "Program",
    "ExecObj",
    "Util",
    "QStatus",
]


def test_backend_is_available(backend: DeviceBackend) -> None:
    assert backend.is_available()
    assert backend.capabilities <= CAPABILITIES, backend.capabilities - CAPABILITIES


def test_runtime_has_qaicrt_names(qaicrt: ModuleType) -> None:
    missing = [n for n in RUNTIME_NAMES if not hasattr(qaicrt, n)]
    assert not missing, f"runtime lacks {missing}"


def test_status_codes_match_the_runtime(qaicrt: ModuleType) -> None:
    for status in QStatus:
        assert int(getattr(qaicrt.QStatus, status.name)) == status.value, status


def test_devices_are_listed_with_resources(qaicrt: ModuleType) -> None:
    util = qaicrt.Util()
    status, ids = util.getDeviceIds()
    assert status == qaicrt.QStatus.SUCCESS
    assert len(ids) >= 1
    status, info = util.getResourceInfo(ids[0])
    assert status == qaicrt.QStatus.SUCCESS
    assert info.nspTotal >= 1 and 0 <= info.nspFree <= info.nspTotal
    assert info.dramTotal > 0 and 0 <= info.dramFree <= info.dramTotal


@pytest.fixture(scope="module")
def accumulator_qpc(backend: DeviceBackend, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if "compile" not in backend.capabilities or backend.compiler is None:
        pytest.skip(f"backend {backend.name!r} does not claim compile")
    root = tmp_path_factory.mktemp("accumulator")
    onnx_path = write_accumulator(root / "accumulator.onnx")
    specs = [Specialization("one", {"batch_size": 1}), Specialization("two", {"batch_size": 2})]
    layout.write_specializations(root / layout.SPECIALIZATIONS_FILE, specs)
    backend.compiler(
        [
            "-aic-hw",
            "-aic-hw-version=ai100",
            f"-m={onnx_path}",
            "-retained-state",
            "-aic-num-cores=1",
            f"-network-specialization-config={root / layout.SPECIALIZATIONS_FILE}",
            f"-aic-binary-dir={root / 'qpc'}",
        ]
    )
    assert layout.qpc_exists(root)
    return root / "qpc"


class _Session:
    """The minimal QEfficient-style call sequence, written against the runtime names only."""

    def __init__(self, qaicrt: ModuleType, aicapi: ModuleType, qpc_dir: Path) -> None:
        self.rt = qaicrt
        status, ids = qaicrt.Util().getDeviceIds()
        self.device = ids[0]
        self.ctx = qaicrt.Context(qaicrt.QIDList([self.device]))
        self.queue = qaicrt.Queue(self.ctx, self.device)
        self.qpc = qaicrt.Qpc(str(qpc_dir))
        iodesc = aicapi.IoDesc()
        status, data = self.qpc.getIoDescriptor()
        assert status == qaicrt.QStatus.SUCCESS
        iodesc.ParseFromString(bytes(data))
        self.bindings = list(iodesc.selected_set.bindings)
        self.allowed_shapes = [
            [(BUFFER_DTYPES[BufferType(s.type)].itemsize, list(s.dims)) for s in shape.shapes]
            for shape in iodesc.allowed_shapes
        ]
        props = qaicrt.QAicProgramProperties()
        props.dataPathTimeoutMs = 60000
        self.program = qaicrt.Program(self.ctx, self.device, self.qpc, props)
        assert self.program.load() == qaicrt.QStatus.SUCCESS
        assert self.program.activate() == qaicrt.QStatus.SUCCESS
        self.exe = qaicrt.ExecObj(self.ctx, self.program)

    def run(
        self, arrays: dict[str, Any], out_shapes: dict[str, list[int]]
    ) -> tuple[int, dict[str, np.ndarray]]:
        buffers, dims = [], []
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
        if status != self.rt.QStatus.SUCCESS:
            return int(status), {}
        status, outs = self.exe.getData()
        result = {}
        for b, buf, (_, shape) in zip(self.bindings, outs, dims, strict=True):
            if b.dir == 1 and int(np.prod(shape)) > 0:
                result[b.name] = np.frombuffer(bytes(buf), dtype=BUFFER_DTYPES[BufferType(b.type)]).reshape(
                    shape
                )
        return int(status), result

    def close(self) -> None:
        self.program.deactivate()


@pytest.mark.requires("compile", "retained_state")
def test_retained_state_round_trips(qaicrt: ModuleType, aicapi: ModuleType, accumulator_qpc: Path) -> None:
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
    qaicrt: ModuleType, aicapi: ModuleType, accumulator_qpc: Path
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
