"""The ``qaicrt`` surface every device backend implements, as Protocols, so drift is a type error.

A backend's ``runtime()`` returns a module following :class:`QaicrtModule` and its ``aicapi()``
one following :class:`AicApiModule` (see :class:`qaic_core.descriptors.DeviceBackend`). Calls
return a status or a ``(status, value)`` tuple as the real module does; a status is anything
``int()`` turns into a :class:`qaic_core.types.QStatus` code. Arguments that must be objects of the
same runtime (a context, a program, an exec object, properties, a slicing handle) are typed
``Any``: no runtime accepts another's objects, so the contract cannot promise it.

Only what the stack calls is here. :func:`missing_members` checks a module or object at run time
against a Protocol (the conformance suite uses it), so the names live in this file alone.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol, SupportsInt, TypeAlias

import numpy as np

Status: TypeAlias = SupportsInt
"""A ``QStatus`` value: ``int(status)`` is its code, ``status == QStatus.QS_SUCCESS`` compares."""

SlicingSpecHandle: TypeAlias = Any
"""Opaque: what ``Program.createSlicingSpecHandle`` gives, passed back to ``setDataWithSlices``."""

Dims: TypeAlias = tuple[int, Sequence[int]]
"""One binding's ``(itemsize, dims)``."""


# -- status codes and log levels (enum classes of the module) ---------------------------------
class StatusCodes(Protocol):
    """``qaicrt.QStatus``: the codes spelled ``QS_*`` (values in :class:`qaic_core.types.QStatus`)."""

    @property
    def QS_SUCCESS(self) -> Status: ...
    @property
    def QS_PERM(self) -> Status: ...
    @property
    def QS_AGAIN(self) -> Status: ...
    @property
    def QS_NOMEM(self) -> Status: ...
    @property
    def QS_BUSY(self) -> Status: ...
    @property
    def QS_NODEV(self) -> Status: ...
    @property
    def QS_INVAL(self) -> Status: ...
    @property
    def QS_NOSPC(self) -> Status: ...
    @property
    def QS_BADFD(self) -> Status: ...
    @property
    def QS_TIMEDOUT(self) -> Status: ...
    @property
    def QS_PROTOCOL(self) -> Status: ...
    @property
    def QS_UNSUPPORTED(self) -> Status: ...
    @property
    def QS_DATA_CRC_ERROR(self) -> Status: ...
    @property
    def QS_DEV_ERROR(self) -> Status: ...
    @property
    def QS_ERROR(self) -> Status: ...


class LogLevels(Protocol):
    """``qaicrt.QLogLevel``: the level ``Context.setLogLevel`` takes for debug logs."""

    @property
    def QL_DEBUG(self) -> SupportsInt: ...


# -- host buffers --------------------------------------------------------------------------
class QIDList(Protocol):
    """``qaicrt.QIDList(ids)``: the device ids a context spans."""

    def __iter__(self) -> Iterator[int]: ...
    def __len__(self) -> int: ...


class QBuffer(Protocol):
    """``qaicrt.QBuffer(bytes)``: a host buffer; ``bytes(buf)`` reads it back."""

    @property
    def size(self) -> int: ...
    def __bytes__(self) -> bytes: ...


class BufferDimensionsVecRef(Protocol):
    """``qaicrt.BufferDimensionsVecRef([(itemsize, dims), ...])``: one entry per binding."""

    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Dims]: ...
    def __getitem__(self, index: int, /) -> Dims: ...


# -- device queries ------------------------------------------------------------------------
class QResourceInfo(Protocol):
    """``Util.getResourceInfo``: resource counts of one QID, DDR in MB."""

    nspTotal: int
    nspFree: int
    dramTotal: int
    dramFree: int
    vcTotal: int
    mcidTotal: int
    semTotal: int
    pcTotal: int
    skuType: str


class QDevInfo(Protocol):
    """``Util.getDeviceInfo``: identity of one QID.

    The field names are the simulator's; the real record's are unverified, so the conformance suite
    does not require them.
    """

    skuType: str
    cardId: int
    socId: int
    pciVendorId: int
    pciDeviceId: int
    nspTotal: int
    dramTotal: int


class QPerformanceInfo(Protocol):
    """``Util.getPerformanceInfo``: runs and device time of one QID (capability ``timing``).

    The field names are the simulator's; the real record's are unverified, so the conformance suite
    does not require them.
    """

    numRuns: int
    deviceTimeS: float
    wallTimeS: float
    avgDeviceTimeUs: float


class Util(Protocol):
    """``qaicrt.Util()``: device ids, identity, free resources and performance counters."""

    def getDeviceIds(self) -> tuple[Status, Sequence[int]]: ...
    def getDeviceInfo(self, qid: int, /) -> tuple[Status, QDevInfo | None]: ...
    def getResourceInfo(self, qid: int, /) -> tuple[Status, QResourceInfo | None]: ...
    def getPerformanceInfo(self, qid: int, /) -> tuple[Status, QPerformanceInfo | None]: ...


# -- programs and runs ---------------------------------------------------------------------
class Context(Protocol):
    """``qaicrt.Context(QIDList | None)``: the devices this process works with."""

    def setLogLevel(self, level: SupportsInt, /) -> Status: ...


class Queue(Protocol):
    """``qaicrt.Queue(ctx, device)``: runs enqueued exec objects."""

    def enqueue(self, exe: Any, /) -> Status: ...


class Qpc(Protocol):
    """``qaicrt.Qpc(path)``: a compiled program on disk (the folder holding ``programqpc.bin``)."""

    def getIoDescriptor(self) -> tuple[Status, bytes]: ...


class QAicProgramProperties(Protocol):
    """``qaicrt.QAicProgramProperties()``: the settings the stack sets before ``Program``."""

    dataPathTimeoutMs: int
    devMapping: str


class Program(Protocol):
    """``qaicrt.Program(ctx, device or None, qpc, props)``: ``load`` takes DDR, ``activate`` cores."""

    def load(self) -> Status: ...
    def activate(self) -> Status: ...
    def deactivate(self) -> Status: ...
    def unload(self) -> Status: ...
    def createSlicingSpecHandle(self, spec_json: str, /) -> tuple[Status, SlicingSpecHandle]: ...


class ExecObj(Protocol):
    """``qaicrt.ExecObj(ctx, program)``: one set of buffers; enqueue it, then wait for it.

    ``setData(qbuffers, dims)`` copies; ``setData([(binding_index, ndarray), ...])`` is zero-copy
    (outputs are filled in place and must outlive the wait).
    """

    def setData(
        self,
        buffers: Sequence[QBuffer] | Sequence[tuple[int, np.ndarray]],
        dims: BufferDimensionsVecRef | None = None,
        /,
    ) -> Status: ...
    def setDataWithSlices(
        self,
        buffers: Sequence[tuple[int, np.ndarray]],
        handle: SlicingSpecHandle,
        params: Sequence[tuple[str, int]],
        /,
    ) -> tuple[Status, object]: ...
    def waitForCompletion(self) -> Status: ...
    def getData(self) -> tuple[Status, Sequence[QBuffer]]: ...


# -- the IoDesc message of the aicapi module ---------------------------------------------------
class IoBinding(Protocol):
    """One binding of an IO set (``dir`` 0 in, 1 out; ``size`` in bytes)."""

    @property
    def name(self) -> str: ...
    @property
    def index(self) -> int: ...
    @property
    def type(self) -> int: ...
    @property
    def dir(self) -> int: ...
    @property
    def dims(self) -> Sequence[int]: ...
    @property
    def size(self) -> int: ...
    @property
    def quant_scale(self) -> float: ...
    @property
    def quant_offset(self) -> int: ...
    @property
    def is_partial_buf_allowed(self) -> bool: ...


class IoSet(Protocol):
    """A named set of bindings (``default``)."""

    @property
    def name(self) -> str: ...
    @property
    def bindings(self) -> Sequence[IoBinding]: ...


class Shape(Protocol):
    """One binding's buffer type and dims in one specialization."""

    @property
    def type(self) -> int: ...
    @property
    def dims(self) -> Sequence[int]: ...


class AllowedShapes(Protocol):
    """One specialization: every binding's shape in binding order."""

    @property
    def shapes(self) -> Sequence[Shape]: ...


class IoDesc(Protocol):
    """``aicapi.IoDesc()``: parses ``Qpc.getIoDescriptor()`` bytes."""

    @property
    def io_sets(self) -> Sequence[IoSet]: ...
    @property
    def selected_set(self) -> IoSet: ...
    @property
    def allowed_shapes(self) -> Sequence[AllowedShapes]: ...
    def ParseFromString(self, data: bytes, /) -> object: ...


# -- the modules -------------------------------------------------------------------------------
# Aliases: inside the module Protocols the class names are taken by the constructors.
_Context: TypeAlias = Context
_Queue: TypeAlias = Queue
_Qpc: TypeAlias = Qpc
_Program: TypeAlias = Program
_ExecObj: TypeAlias = ExecObj
_Util: TypeAlias = Util
_QIDList: TypeAlias = QIDList
_QBuffer: TypeAlias = QBuffer
_BufferDimensionsVecRef: TypeAlias = BufferDimensionsVecRef
_QAicProgramProperties: TypeAlias = QAicProgramProperties
_IoDesc: TypeAlias = IoDesc


class QaicrtModule(Protocol):
    """The ``qaicrt`` module: constructors (class objects) and the status and log-level enums."""

    def QIDList(self, ids: Iterable[int], /) -> _QIDList: ...
    def Context(self, devices: _QIDList | None = None, /) -> _Context: ...
    def Queue(self, ctx: Any, device: int, /) -> _Queue: ...
    def Qpc(self, path: str, /) -> _Qpc: ...
    def QAicProgramProperties(self) -> _QAicProgramProperties: ...
    def Program(self, ctx: Any, device: int | None, qpc: Any, props: Any, /) -> _Program: ...
    def ExecObj(self, ctx: Any, program: Any, /) -> _ExecObj: ...
    def QBuffer(self, data: bytes, /) -> _QBuffer: ...
    def BufferDimensionsVecRef(self, dims: Iterable[Dims], /) -> _BufferDimensionsVecRef: ...
    def Util(self) -> _Util: ...
    @property
    def QStatus(self) -> StatusCodes: ...
    @property
    def QLogLevel(self) -> LogLevels: ...


class AicApiModule(Protocol):
    """The ``aicapi`` module (``QAicApi_pb2``): the ``IoDesc`` message."""

    def IoDesc(self) -> _IoDesc: ...


def protocol_members(protocol: type) -> list[str]:
    """The public member names a Protocol declares (with its Protocol bases), sorted.

    Dunder members are left to mypy: a compiled binding may give ``bytes()`` through the buffer
    protocol rather than ``__bytes__``.
    """
    names: set[str] = set()
    for base in protocol.__mro__:
        if base is Protocol or base is object or not getattr(base, "_is_protocol", False):
            continue
        names.update(inspect.get_annotations(base))
        names.update(vars(base))
    return sorted(n for n in names if not n.startswith("_"))


def missing_members(obj: object, protocol: type) -> list[str]:
    """The members of ``protocol`` that ``obj`` (a module, class or instance) lacks."""
    return [name for name in protocol_members(protocol) if not hasattr(obj, name)]
