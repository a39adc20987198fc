"""The runtime's ``IoDesc`` protobuf (``QAicApi_pb2``), built at import time from a descriptor.

Callers parse ``Qpc.getIoDescriptor()`` bytes exactly as with the real module::

    iodesc = aicapi.IoDesc()
    iodesc.ParseFromString(bytes(data))
    iodesc.selected_set.bindings[i].name / .index / .type / .dir / .dims / .size
    iodesc.allowed_shapes[k].shapes[i].type / .dims

Field numbers are this simulator's own; the bytes never leave it.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from qaic_core.types import BufferType, Direction

_F = descriptor_pb2.FieldDescriptorProto
_PACKAGE = "qaic_sim.aicapi"

FLOAT_TYPE = int(BufferType.FLOAT)
FLOAT_16_TYPE = int(BufferType.FLOAT_16)
INT8_Q_TYPE = int(BufferType.INT8_Q)
UINT8_Q_TYPE = int(BufferType.UINT8_Q)
INT16_Q_TYPE = int(BufferType.INT16_Q)
INT32_Q_TYPE = int(BufferType.INT32_Q)
INT32_I_TYPE = int(BufferType.INT32_I)
INT64_I_TYPE = int(BufferType.INT64_I)
INT8_TYPE = int(BufferType.INT8)
BFLOAT16_TYPE = int(BufferType.BFLOAT16)
BUFFER_IO_TYPE_INPUT = int(Direction.IN)
BUFFER_IO_TYPE_OUTPUT = int(Direction.OUT)


def _field(msg: descriptor_pb2.DescriptorProto, name: str, number: int, kind: int, **kw: Any) -> None:
    field = msg.field.add(name=name, number=number, type=kind, **kw)
    if "label" not in kw:
        field.label = _F.LABEL_OPTIONAL


def _file() -> descriptor_pb2.FileDescriptorProto:
    fdp = descriptor_pb2.FileDescriptorProto(name="qaic_sim_aicapi.proto", package=_PACKAGE, syntax="proto3")
    rep = _F.LABEL_REPEATED

    binding = fdp.message_type.add(name="IoBinding")
    _field(binding, "name", 1, _F.TYPE_STRING)
    _field(binding, "index", 2, _F.TYPE_INT32)
    _field(binding, "type", 3, _F.TYPE_INT32)
    _field(binding, "dir", 4, _F.TYPE_INT32)
    _field(binding, "quant_scale", 5, _F.TYPE_DOUBLE)
    _field(binding, "quant_offset", 6, _F.TYPE_INT32)
    _field(binding, "dims", 7, _F.TYPE_INT64, label=rep)
    _field(binding, "size", 8, _F.TYPE_INT64)
    _field(binding, "is_partial_buf_allowed", 9, _F.TYPE_BOOL)

    ioset = fdp.message_type.add(name="IoSet")
    _field(ioset, "name", 1, _F.TYPE_STRING)
    _field(ioset, "bindings", 2, _F.TYPE_MESSAGE, label=rep, type_name=f".{_PACKAGE}.IoBinding")

    shape = fdp.message_type.add(name="Shape")
    _field(shape, "type", 1, _F.TYPE_INT32)
    _field(shape, "dims", 2, _F.TYPE_INT64, label=rep)

    allowed = fdp.message_type.add(name="AllowedShapes")
    _field(allowed, "shapes", 1, _F.TYPE_MESSAGE, label=rep, type_name=f".{_PACKAGE}.Shape")

    iodesc = fdp.message_type.add(name="IoDesc")
    _field(iodesc, "io_sets", 1, _F.TYPE_MESSAGE, label=rep, type_name=f".{_PACKAGE}.IoSet")
    _field(iodesc, "selected_set", 2, _F.TYPE_MESSAGE, type_name=f".{_PACKAGE}.IoSet")
    _field(iodesc, "allowed_shapes", 3, _F.TYPE_MESSAGE, label=rep, type_name=f".{_PACKAGE}.AllowedShapes")
    return fdp


_POOL = descriptor_pool.DescriptorPool()
_POOL.Add(_file())


def _cls(name: str) -> Any:
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"{_PACKAGE}.{name}"))


IoBinding = _cls("IoBinding")
IoSet = _cls("IoSet")
Shape = _cls("Shape")
AllowedShapes = _cls("AllowedShapes")
IoDesc = _cls("IoDesc")

__all__ = [
    "BFLOAT16_TYPE",
    "BUFFER_IO_TYPE_INPUT",
    "BUFFER_IO_TYPE_OUTPUT",
    "FLOAT_16_TYPE",
    "FLOAT_TYPE",
    "INT8_Q_TYPE",
    "INT8_TYPE",
    "INT16_Q_TYPE",
    "INT32_I_TYPE",
    "INT32_Q_TYPE",
    "INT64_I_TYPE",
    "UINT8_Q_TYPE",
    "AllowedShapes",
    "IoBinding",
    "IoDesc",
    "IoSet",
    "Shape",
]
