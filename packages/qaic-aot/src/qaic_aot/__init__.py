"""Ahead-of-time path: Hugging Face model to ONNX to a cached QPC to an inference session."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from qaic_aot.causal_lm import CausalLM
    from qaic_aot.compile import compile_model
    from qaic_aot.session import QAICInferenceSession, RunHandle
    from qaic_aot.validate import validate_qpc

_EXPORTS = {
    "CausalLM": "qaic_aot.causal_lm",
    "compile_model": "qaic_aot.compile",
    "QAICInferenceSession": "qaic_aot.session",
    "RunHandle": "qaic_aot.session",
    "validate_qpc": "qaic_aot.validate",
}

__all__ = ["CausalLM", "QAICInferenceSession", "RunHandle", "__version__", "compile_model", "validate_qpc"]


def __getattr__(name: str) -> Any:
    """Import on first use so that loading the plugin stays cheap (no torch, no onnx)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'qaic_aot' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
