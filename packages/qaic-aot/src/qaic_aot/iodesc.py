"""Reading a program's IO descriptor (bindings and allowed shapes) through the backend's runtime."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from qaic_core import qpc as layout
from qaic_core.advice import status_advice
from qaic_core.errors import QaicConfigError, QaicRuntimeError
from qaic_core.runtime import AicApiModule, QaicrtModule, Qpc, Status
from qaic_core.types import BUFFER_DTYPES, Binding, BufferType, Direction, QStatus


@dataclass(frozen=True)
class ProgramIo:
    """Bindings in index order and, per specialization, each binding's (itemsize, dims)."""

    bindings: list[Binding]
    allowed_shapes: list[list[tuple[int, list[int]]]]


def program_dir(qpc_path: Path | str) -> Path:
    """The folder holding ``programqpc.bin``, from a ``qpc-<hash>`` directory or the folder itself."""
    program = layout.program_path(Path(qpc_path))
    if not program.is_file():
        raise QaicConfigError(
            f"compiled program {program} is missing: compile the model first (qaic-aot compile) "
            "or give the qpc directory that holds qpc/programqpc.bin"
        )
    return program.parent


def status_name(status: Status) -> str:
    """The QStatus name of a runtime status (SUCCESS, INVAL, ...), whatever enum the runtime uses."""
    try:
        return QStatus(int(status)).name
    except (TypeError, ValueError):
        return str(status)


def check(status: Status, what: str, *, detail: str = "", advice: str | None = None) -> None:
    """Raise ``QaicRuntimeError`` naming the call, the status and the fix unless it is SUCCESS.

    ``detail`` is the runtime's own explanation where it gives one (the simulator's ``lastError``);
    ``advice`` the fix, by default what :func:`qaic_core.advice.status_advice` says for the status,
    so a real card's bare status reads like the simulator's.
    """
    code = int(status)
    if code != QStatus.SUCCESS:
        fix = status_advice(code, what) if advice is None else advice
        message = f"{what} failed with status {status_name(code)} ({code})"
        if detail:
            message += f": {detail}"
        if fix:
            message += f"; {fix}"
        raise QaicRuntimeError(message, status=code)


def read_program_io(runtime: QaicrtModule, aicapi: AicApiModule, qpc: Qpc) -> ProgramIo:
    """Parse ``qpc.getIoDescriptor()`` with the backend's ``IoDesc`` message."""
    status, data = qpc.getIoDescriptor()
    check(status, "Qpc.getIoDescriptor")
    desc = aicapi.IoDesc()
    desc.ParseFromString(bytes(data))
    bindings = [
        Binding(
            name=b.name,
            index=int(b.index),
            type=BufferType(int(b.type)),
            dir=Direction(int(b.dir)),
            dims=tuple(int(d) for d in b.dims),
            size=int(b.size),
            quant_scale=float(b.quant_scale),
            quant_offset=int(b.quant_offset),
            is_partial_buf_allowed=bool(b.is_partial_buf_allowed),
        )
        for b in desc.selected_set.bindings
    ]
    bindings.sort(key=lambda b: b.index)
    allowed = [
        [(BUFFER_DTYPES[BufferType(int(s.type))].itemsize, [int(d) for d in s.dims]) for s in shape.shapes]
        for shape in desc.allowed_shapes
    ]
    if not allowed and bindings:
        # A program of one specialization lists no allowed shapes: its only shape is the bindings'
        # dims (what QEfficient's _fetch_full_batch_size falls back to).
        allowed = [[(b.dtype.itemsize, list(b.dims)) for b in bindings]]
    return ProgramIo(bindings, allowed)


def load_program_io(runtime: QaicrtModule, aicapi: AicApiModule, qpc_path: Path | str) -> ProgramIo:
    """Bindings and allowed shapes of a compiled program on disk (no device needed)."""
    return read_program_io(runtime, aicapi, runtime.Qpc(str(program_dir(qpc_path))))
