"""Registers the ``aot`` execution path (export, compile (cached) and run a QPC program), its model
loaders ``hf`` and ``qpc`` and its session factory ``qaicrt``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from qaic_aot import loaders
from qaic_aot.export.families import SUPPORTED_ARCHITECTURES
from qaic_aot.export.pooling_archs import POOLING_ARCHITECTURES
from qaic_core import get_plugin_manager, hookimpl
from qaic_core.descriptors import (
    HF_CHECKPOINT,
    PROGRAM_KINDS,
    QPC,
    ExecutionPath,
    ModelLoader,
    SessionFactory,
)
from qaic_core.execution import GENERATE, OVERLAP, SLOT_KV_TRANSFER, SPECULATIVE_VERIFY

if TYPE_CHECKING:
    from qaic_aot.pooling import AotPoolingModel
    from qaic_aot.step_model import AotStepModel
    from qaic_core.execution import ExecutionConfig, ShapeChoice, ShapeRequest


def open_step_model(config: ExecutionConfig) -> AotStepModel | AotPoolingModel:
    """Imported on use: loading the plugin stays free of torch and onnx. Pooling tasks open a pooling model."""
    if config.task != GENERATE:
        from qaic_aot import pooling

        return pooling.open_pooling_model(config)
    from qaic_aot import step_model

    return step_model.open_step_model(config)


def size_shape(request: ShapeRequest) -> ShapeChoice:
    """The program's memory as the compiler counts it (:mod:`qaic_aot.memory`), imported on use."""
    from qaic_aot import memory

    return memory.size_shape(request)


def check(config: ExecutionConfig) -> None:
    """The loader and session factory the configuration names exist and apply; then the path's own checks."""
    pm = get_plugin_manager()
    pm.select_model_loader(config, PROGRAM_KINDS, "aot")
    pm.select_session_factory(config.session)
    if config.task != GENERATE:
        from qaic_aot import pooling

        pooling.check(config)
        return
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
            pooling_architectures=frozenset(POOLING_ARCHITECTURES),
            size=size_shape,
            loader_kinds=PROGRAM_KINDS,
        )
    ]


@hookimpl
def qaic_model_loaders() -> list[ModelLoader]:
    return [
        ModelLoader(
            name=loaders.HF_LOADER,
            package="qaic-aot",
            kind=HF_CHECKPOINT,
            load=loaders.load_checkpoint,
            applies=loaders.compiles,
            description="a Hugging Face checkpoint exported to ONNX and compiled to a cached QPC "
            "(when no qpc_path is given)",
            priority=10,
        ),
        ModelLoader(
            name=loaders.QPC_LOADER,
            package="qaic-aot",
            kind=QPC,
            load=loaders.load_prebuilt,
            applies=loaders.has_prebuilt,
            description="a prebuilt QPC from qpc_path, checked against the model and the shapes",
            priority=10,
        ),
    ]


@hookimpl
def qaic_session_factories() -> list[SessionFactory]:
    return [
        SessionFactory(
            name=loaders.QAICRT_SESSION,
            package="qaic-aot",
            open=loaders.open_runtime_session,
            description="QEfficient's QAICInferenceSession surface over the backend's qaicrt runtime",
            priority=10,
        )
    ]
