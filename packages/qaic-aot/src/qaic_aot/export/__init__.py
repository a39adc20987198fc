"""Export a Hugging Face causal LM to ONNX with QEfficient's IO contract (KV cache as retained state)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from qaic_aot.export.contract import ExportResult, input_names, output_names
from qaic_aot.export.families import SUPPORTED_ARCHITECTURES, check_architecture, decoder_spec

if TYPE_CHECKING:
    from qaic_aot.export.onnx_export import export_onnx, load_config

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "ExportResult",
    "check_architecture",
    "decoder_spec",
    "export_onnx",
    "input_names",
    "load_config",
    "output_names",
]


def __getattr__(name: str) -> Any:
    """Import the exporter (onnx, torch) on first use, so the architecture list stays cheap to read."""
    if name not in ("export_onnx", "load_config"):
        raise AttributeError(f"module 'qaic_aot.export' has no attribute {name!r}")
    from qaic_aot.export import onnx_export

    return getattr(onnx_export, name)
