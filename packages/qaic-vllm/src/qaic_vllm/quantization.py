"""The ``mxfp6`` quantization name: weights become MX6 at compile time (-mxfp6-matmul), not at load."""

from __future__ import annotations

from typing import Any

import torch


def register_mxfp6() -> None:
    """Teach vLLM the ``mxfp6`` quantization name (weights become MX6 at compile time, not at load)."""
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, register_quantization_config
    from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

    if "mxfp6" in QUANTIZATION_METHODS:
        return

    @register_quantization_config("mxfp6")
    class Mxfp6Config(QuantizationConfig):
        """Marker config: the Cloud AI compiler quantizes matmul weights with -mxfp6-matmul."""

        def get_name(self) -> Any:
            return "mxfp6"

        def get_supported_act_dtypes(self) -> list[torch.dtype]:
            return [torch.float16, torch.float32]

        @classmethod
        def get_min_capability(cls) -> int:
            return 0

        @staticmethod
        def get_config_filenames() -> list[str]:
            return []

        @classmethod
        def from_config(cls, config: dict[str, Any]) -> Mxfp6Config:
            return cls()

        def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> None:
            return None


def register_mxint8_kv_cache() -> None:
    """Teach vLLM the ``mxint8`` KV cache dtype, so ``LLM(kv_cache_dtype="mxint8")`` passes its validation.

    The cache itself lives on the device (custom_io.yaml); vLLM only keeps the name.
    """
    from vllm.config import cache as vllm_cache

    if vllm_cache.is_known_kv_cache_dtype("mxint8"):
        return

    @vllm_cache.register_kv_cache_dtype("mxint8")
    class Mxint8KVCache:
        """MX INT8: 8-bit values with a shared scale per 32, kept on the device."""

        name = "mxint8"

        def torch_dtype(self) -> torch.dtype:
            return torch.uint8

        def quant_mode(self) -> Any:
            from vllm.v1.kv_cache_interface import KVQuantMode

            return KVQuantMode.CUSTOM
