"""Registers the simulator as the ``sim`` device backend."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from qaic_core import hookimpl
from qaic_core.descriptors import DeviceBackend
from qaic_core.runtime import AicApiModule, QaicrtModule

CAPABILITIES = frozenset(
    {
        "compile",
        "retained_state",
        "multi_device",
        "mxfp6",
        "mxint8",
        "fp16",
        "slicing",
        "faults",
        "traces",
        "timing",
    }
)


def runtime() -> QaicrtModule:
    from qaic_sim import qaicrt

    return qaicrt


def aicapi() -> AicApiModule:
    from qaic_sim import aicapi as module

    return module


if TYPE_CHECKING:
    # The simulator is the reference implementation of the runtime contract: a drift is a mypy error.
    from qaic_sim import aicapi as _aicapi_module
    from qaic_sim import qaicrt as _qaicrt_module

    _RUNTIME_CONTRACT: QaicrtModule = _qaicrt_module
    _AICAPI_CONTRACT: AicApiModule = _aicapi_module


def compile_qpc(args: Sequence[str]) -> None:
    """Compile like ``qaic-compile`` (argv without the program name); raises on bad input."""
    from qaic_sim.compiler import compile_argv

    compile_argv(list(args))


@hookimpl
def qaic_device_backends() -> list[DeviceBackend]:
    return [
        DeviceBackend(
            name="sim",
            package="qaic-sim",
            runtime=runtime,
            aicapi=aicapi,
            compiler=compile_qpc,
            priority=10,
            capabilities=CAPABILITIES,
            description="CPU simulator of Cloud AI 100 cards (onnxruntime)",
        )
    ]
