"""Rotary tables computed with transformers' own frequency functions, so every rope type matches it."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from qaic_aot.export.families import DecoderSpec, rope_parameters


def inverse_frequencies(config: Any, spec: DecoderSpec) -> tuple[torch.Tensor, float]:
    """``(inv_freq, attention_scaling)`` exactly as the model's rotary embedding computes them."""
    params = rope_parameters(config)
    rope_type = params.get("rope_type", "default")
    if rope_type == "default" or rope_type == "dynamic":
        # Dynamic NTK equals the default inside max_position_embeddings (checked by decoder_spec).
        base = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        dim = spec.rotary_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


def rope_tables(config: Any, spec: DecoderSpec, num_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of shape [num_positions, rotary_dim], row p for position p."""
    inv_freq, scaling = inverse_frequencies(config, spec)
    positions = torch.arange(num_positions, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = (emb.cos() * scaling).to(torch.float32).numpy()
    sin = (emb.sin() * scaling).to(torch.float32).numpy()
    return cos, sin
