"""Registers the ``aot`` execution path: export, compile (cached) and run a QPC program."""

from __future__ import annotations

from typing import TYPE_CHECKING

from qaic_aot.export.families import SUPPORTED_ARCHITECTURES
from qaic_core import hookimpl
from qaic_core.descriptors import ExecutionPath
from qaic_core.execution import OVERLAP, SLOT_KV_TRANSFER, SPECULATIVE_VERIFY

if TYPE_CHECKING:
    from qaic_aot.step_model import AotStepModel
    from qaic_core.execution import ExecutionConfig


def open_step_model(config: ExecutionConfig) -> AotStepModel:
    """Imported on use: loading the plugin stays free of torch and onnx."""
    from qaic_aot import step_model

    return step_model.open_step_model(config)


def check(config: ExecutionConfig) -> None:
    from qaic_aot import step_model

    step_model.check(config)


@hookimpl
def qaic_execution_paths() -> list[ExecutionPath]:
    return [
        ExecutionPath(
            name="aot",
            package="qaic-aot",
            architectures=frozenset(SUPPORTED_ARCHITECTURES),
            open=open_step_model,
            check=check,
            capabilities=frozenset({OVERLAP, SPECULATIVE_VERIFY, SLOT_KV_TRANSFER}),
            priority=10,
            description="export to ONNX, compile to a cached QPC and run it (QEfficient's IO contract)",
        )
    ]
