"""The ``qaic`` attention implementation: the model's own eager attention over the whole KV context.

Registered in transformers' ``AttentionInterface``; it replaces the mask the model built (from a cache it
does not know) with one made from the step's real positions, then calls the ``eager_attention_forward``
of the model's own modelling file, so soft-capping, attention sinks and scaling stay the model's.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from transformers import AttentionInterface

from qaic_aot.export.traced import step as steps

NAME = "qaic"


def _eager_of(module: torch.nn.Module) -> Any:
    modelling = sys.modules[type(module).__module__]
    fn = getattr(modelling, "eager_attention_forward", None)
    if fn is None:
        from transformers.models.llama.modeling_llama import eager_attention_forward

        fn = eager_attention_forward
    return fn


def qaic_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of one layer; ``sliding_window`` (when the layer has one) narrows the mask."""
    step = steps.current()
    mask = step.mask(kwargs.get("sliding_window"))
    kwargs["dropout"] = 0.0
    out, _weights = _eager_of(module)(module, query, key, value, mask, **kwargs)
    return out, None


def register() -> str:
    """Register the implementation (idempotent); returns its name."""
    AttentionInterface.register(NAME, qaic_attention)
    return NAME
