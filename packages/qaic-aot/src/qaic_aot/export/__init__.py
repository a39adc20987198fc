"""Export a Hugging Face causal LM to ONNX with QEfficient's IO contract (KV cache as retained state)."""

from __future__ import annotations

from qaic_aot.export.contract import ExportResult, input_names, output_names
from qaic_aot.export.families import SUPPORTED_ARCHITECTURES, check_architecture, decoder_spec
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
