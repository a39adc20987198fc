"""Device memory of an eager model: weights and KV cache bytes, known before any weight is loaded."""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger("qaic.pyt")

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def torch_dtype(name: str) -> torch.dtype:
    key = str(name).removeprefix("torch.")
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}: use one of {', '.join(DTYPES)}")
    return DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def weight_bytes(hf_config: Any, dtype: torch.dtype) -> int | None:
    """The model's parameter bytes at ``dtype``, counted on the meta device (nothing allocated).

    None when transformers cannot build the architecture from its config alone.
    """
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    except Exception as exc:  # an architecture transformers cannot build without remote code, ...
        log.info("qaic: cannot size %s's weights before loading (%s)", type(hf_config).__name__, exc)
        return None
    item = torch.empty((), dtype=dtype).element_size()
    return sum(p.numel() for p in model.parameters()) * item


def kv_bytes_per_token(hf_config: Any, dtype: torch.dtype) -> int:
    """Keys and values one token adds to the cache over every layer."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    layers = int(text.num_hidden_layers)
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    item = torch.empty((), dtype=dtype).element_size()
    return 2 * layers * kv_heads * head_dim * item


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of a loaded module's parameters and buffers (shared tensors counted once)."""
    seen: set[int] = set()
    total = 0
    for tensor in [*module.parameters(), *module.buffers()]:
        key = tensor.data_ptr() if tensor.device.type != "meta" else id(tensor)
        if key in seen:
            continue
        seen.add(key)
        total += tensor.numel() * tensor.element_size()
    return total


def mb(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f} MB"
