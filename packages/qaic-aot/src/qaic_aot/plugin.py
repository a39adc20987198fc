"""Registers the AOT session backend and model loader."""

from __future__ import annotations

from qaic_aot.compile import compile_model
from qaic_aot.export.families import SUPPORTED_ARCHITECTURES
from qaic_aot.session import QAICInferenceSession
from qaic_core import hookimpl
from qaic_core.descriptors import ModelLoader, SessionBackend


@hookimpl
def qaic_session_backends() -> list[SessionBackend]:
    return [
        SessionBackend(
            name="aot",
            package="qaic-aot",
            factory=QAICInferenceSession,
            description="QEfficient-style QAICInferenceSession over a compiled QPC",
        )
    ]


@hookimpl
def qaic_model_loaders() -> list[ModelLoader]:
    return [
        ModelLoader(
            name="aot",
            package="qaic-aot",
            architectures=frozenset(SUPPORTED_ARCHITECTURES),
            load=compile_model,
            description="export to ONNX and compile to a cached QPC (returns the qpc directory)",
        )
    ]
