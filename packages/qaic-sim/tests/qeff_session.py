"""A session written only against the real runtime's names, the way QEfficient drives qaicrt.

It uses ``QS_SUCCESS``, ``aicapi.FLOAT_TYPE``, ``BUFFER_IO_TYPE_INPUT``, ``QBuffer(bytes)`` and
``BufferDimensionsVecRef`` exactly as the real session does, so a test passing here shows that
such code runs on the simulator unchanged.
"""

from __future__ import annotations

import contextlib
from types import ModuleType
from typing import Any

import numpy as np


class QeffStyleSession:
    def __init__(
        self, qaicrt: ModuleType, aicapi: ModuleType, qpc_path: str, device_ids: list[int] | None = None
    ) -> None:
        self.rt = qaicrt
        self.dtypes = {
            aicapi.FLOAT_TYPE: np.dtype(np.float32),
            aicapi.FLOAT_16_TYPE: np.dtype(np.float16),
            aicapi.INT8_Q_TYPE: np.dtype(np.int8),
            aicapi.INT32_I_TYPE: np.dtype(np.int32),
            aicapi.INT64_I_TYPE: np.dtype(np.int64),
            aicapi.INT8_TYPE: np.dtype(np.int8),
        }
        if device_ids is not None:
            self.context = qaicrt.Context(qaicrt.QIDList(device_ids))
            self.queue = qaicrt.Queue(self.context, device_ids[0])
        else:
            self.context = qaicrt.Context()
            self.queue = qaicrt.Queue(self.context, 0)
        qpc = qaicrt.Qpc(str(qpc_path))
        iodesc = aicapi.IoDesc()
        status, data = qpc.getIoDescriptor()
        assert status == qaicrt.QStatus.QS_SUCCESS
        iodesc.ParseFromString(bytes(data))
        self.allowed_shapes = [
            [(self.dtypes[x.type].itemsize, list(x.dims)) for x in shape.shapes]
            for shape in iodesc.allowed_shapes
        ]
        self.bindings = iodesc.selected_set.bindings
        self.binding_index_map = {b.name: b.index for b in self.bindings}
        self.input_names = [b.name for b in self.bindings if b.dir == aicapi.BUFFER_IO_TYPE_INPUT]
        self.output_names = [b.name for b in self.bindings if b.dir == aicapi.BUFFER_IO_TYPE_OUTPUT]
        props = qaicrt.QAicProgramProperties()
        props.dataPathTimeoutMs = 60_000
        with contextlib.suppress(AttributeError):
            props.SubmitRetryTimeoutMs = 60_000
        device = None
        if device_ids and len(device_ids) == 1:
            device = device_ids[0]
        elif device_ids:
            props.devMapping = ":".join(map(str, device_ids))
        self.program = qaicrt.Program(self.context, device, qpc, props)
        self.load_status = self.program.load()
        if self.load_status != qaicrt.QStatus.QS_SUCCESS:
            return
        assert self.program.activate() == qaicrt.QStatus.QS_SUCCESS
        self.exec_obj = qaicrt.ExecObj(self.context, self.program)
        self.qbuffers = [qaicrt.QBuffer(bytes(b.size)) for b in self.bindings]
        self.buf_dims = qaicrt.BufferDimensionsVecRef(
            [(self.dtypes[b.type].itemsize, list(b.dims)) for b in self.bindings]
        )

    def set_buffers(self, buffers: dict[str, np.ndarray]) -> None:
        for name, buffer in buffers.items():
            index = self.binding_index_map[name]
            self.qbuffers[index] = self.rt.QBuffer(buffer.tobytes())
            self.buf_dims[index] = (buffer.itemsize, buffer.shape if len(buffer.shape) > 0 else (1,))

    def skip_buffers(self, names: list[str]) -> None:
        self.set_buffers({k: np.array([]) for k in names})

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, Any]:
        self.set_buffers(inputs)
        assert self.exec_obj.setData(self.qbuffers, self.buf_dims) == self.rt.QStatus.QS_SUCCESS
        assert self.queue.enqueue(self.exec_obj) == self.rt.QStatus.QS_SUCCESS
        if self.exec_obj.waitForCompletion() != self.rt.QStatus.QS_SUCCESS:
            raise ValueError("Failed to run")
        status, outs = self.exec_obj.getData()
        assert status == self.rt.QStatus.QS_SUCCESS
        result = {}
        for name in self.output_names:
            i = self.binding_index_map[name]
            if self.qbuffers[i].size == 0 or outs[i].size == 0:
                continue
            result[name] = np.frombuffer(bytes(outs[i]), self.dtypes[self.bindings[i].type]).reshape(
                self.buf_dims[i][1]
            )
        return result

    def deactivate(self) -> None:
        self.program.deactivate()
