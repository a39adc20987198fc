"""Registers the simulator as the ``sim`` device backend."""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

from qaic_core import hookimpl
from qaic_core.descriptors import DeviceBackend

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


def runtime() -> ModuleType:
    from qaic_sim import qaicrt

    return qaicrt


def aicapi() -> ModuleType:
    from qaic_sim import aicapi as module

    return module


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
