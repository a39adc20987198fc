"""Registers the AOT session backend and model loader."""

from __future__ import annotations

from qaic_aot.compile import compile_model
from qaic_aot.session import QAICInferenceSession
from qaic_core import hookimpl
from qaic_core.descriptors import ModelLoader, SessionBackend

FALLBACK_ARCHITECTURES = frozenset(
    {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Phi3ForCausalLM",
        "GemmaForCausalLM",
        "GPT2LMHeadModel",
    }
)
"""The contract's list, used only while ``qaic_aot.export`` cannot be imported."""


def supported_architectures() -> frozenset[str]:
    try:
        from qaic_aot.export import SUPPORTED_ARCHITECTURES
    except ImportError:
        return FALLBACK_ARCHITECTURES
    return frozenset(SUPPORTED_ARCHITECTURES)


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
            architectures=supported_architectures(),
            load=compile_model,
            description="export to ONNX and compile to a cached QPC (returns the qpc directory)",
        )
    ]
