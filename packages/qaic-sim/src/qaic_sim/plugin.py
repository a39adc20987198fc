"""Registers the simulator as the ``sim`` device backend."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from qaic_core import hookimpl
from qaic_core.descriptors import DeviceBackend
from qaic_core.eager import EagerDevice, EagerDeviceRequest
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


def compiler_revision() -> str:
    """What the compiled programs depend on beyond the package version (``compiler.compiler_revision``)."""
    from qaic_sim.compiler import compiler_revision as revision

    return revision()


def eager_device(request: EagerDeviceRequest) -> EagerDevice:
    """The eager path's device layer: CPU tensors accounted against a simulated SoC."""
    from qaic_sim.eager import open_eager_device

    return open_eager_device(request)


class MachineTrace:
    """The ``trace`` control: tracing of the current simulated machine (looked up per call)."""

    def start(self, directory: str | os.PathLike[str], run_dirs: bool = True) -> None:
        from qaic_sim.machine import get_machine

        get_machine().trace.start(directory, run_dirs)

    def stop(self) -> Path | None:
        from qaic_sim.machine import get_machine

        return get_machine().trace.stop()

    @property
    def active(self) -> bool:
        from qaic_sim.machine import get_machine

        return get_machine().trace.active


class MachineFaults:
    """The ``faults`` control: the fault plan of the current simulated machine (looked up per call)."""

    def inject(self, kind: str, qid: int = 0, at: int = 1) -> None:
        from qaic_sim.machine import get_machine

        get_machine().faults.inject(kind, qid, at)

    def clear(self) -> None:
        from qaic_sim.machine import get_machine

        get_machine().faults.clear()

    def reset_device(self, qid: int) -> None:
        from qaic_sim.machine import get_machine

        get_machine().faults.reset_device(qid)


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
            trace=MachineTrace(),
            faults=MachineFaults(),
            eager=eager_device,
            compiler_revision=compiler_revision,
        )
    ]
