"""The KV cache of a traced export: a transformers ``Cache`` whose update writes through CtxScatter/CtxGather.

Each layer's ``update`` scatters the new keys/values into ``past_{key,value}.N`` at their positions (the
result is the ``_RetainedState`` output) and gathers the whole context back for attention. The torch
functions compute the same values as the ONNX functions in :mod:`qaic_aot.export.ops`, and export as
those custom ops (domain ``com.qualcomm.cloud``).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from qaic_aot.export.ops import DOMAIN


class CtxScatterCB(torch.autograd.Function):
    """Write ``updates[b, :, s]`` into row ``batch_index[b]`` at ``position_ids[b, s]``; negatives are skipped."""

    @staticmethod
    def forward(
        ctx: Any,
        data: torch.Tensor,
        batch_index: torch.Tensor,
        position_ids: torch.Tensor,
        updates: torch.Tensor,
    ) -> torch.Tensor:
        out = data.clone()
        valid = position_ids >= 0
        rows = batch_index.reshape(-1, 1).expand_as(position_ids)[valid]
        out[rows, :, position_ids[valid]] = updates.transpose(1, 2)[valid]
        return out

    @staticmethod
    def symbolic(g: Any, data: Any, batch_index: Any, position_ids: Any, updates: Any) -> Any:
        return g.op(f"{DOMAIN}::CtxScatterCB", data, batch_index, position_ids, updates).setType(data.type())


class CtxScatter(torch.autograd.Function):
    """Write ``updates[b, :, s]`` into row ``b`` at ``position_ids[b, s]``; negatives are skipped."""

    @staticmethod
    def forward(
        ctx: Any, data: torch.Tensor, position_ids: torch.Tensor, updates: torch.Tensor
    ) -> torch.Tensor:
        rows = torch.arange(position_ids.shape[0]).reshape(-1, 1)
        return CtxScatterCB.forward(ctx, data, rows, position_ids, updates)

    @staticmethod
    def symbolic(g: Any, data: Any, position_ids: Any, updates: Any) -> Any:
        return g.op(f"{DOMAIN}::CtxScatter", data, position_ids, updates).setType(data.type())


class CtxGatherCB(torch.autograd.Function):
    """Read rows ``batch_index`` of the cache at ``ctx_indices`` [1, 1, n]: [batch, heads, n, head_dim]."""

    @staticmethod
    def forward(
        ctx: Any, data: torch.Tensor, batch_index: torch.Tensor, ctx_indices: torch.Tensor
    ) -> torch.Tensor:
        return data[batch_index.reshape(-1)][:, :, ctx_indices.reshape(-1)]

    @staticmethod
    def symbolic(g: Any, data: Any, batch_index: Any, ctx_indices: Any) -> Any:
        return g.op(f"{DOMAIN}::CtxGatherCB", data, batch_index, ctx_indices).setType(data.type())


class CtxGather(torch.autograd.Function):
    """Read every row of the cache at ``ctx_indices`` [1, 1, n]: [batch, heads, n, head_dim]."""

    @staticmethod
    def forward(ctx: Any, data: torch.Tensor, ctx_indices: torch.Tensor) -> torch.Tensor:
        return data[:, :, ctx_indices.reshape(-1)]

    @staticmethod
    def symbolic(g: Any, data: Any, ctx_indices: Any) -> Any:
        return g.op(f"{DOMAIN}::CtxGather", data, ctx_indices).setType(data.type())


class RetainedLayer(CacheLayerMixin):
    """One layer's cache: the ``past_*`` inputs in, the ``_RetainedState`` outputs recorded."""

    is_sliding = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, step: Any) -> None:
        super().__init__()
        self.past = (keys, values)
        self.keys, self.values = keys, values
        self.step = step
        self.is_initialized = True
        self.retained: tuple[torch.Tensor, torch.Tensor] | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        past_keys, past_values = self.past
        kept = (self.step.scatter(past_keys, key_states), self.step.scatter(past_values, value_states))
        self.retained = kept
        return self.step.gather(kept[0]), self.step.gather(kept[1])

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return int(self.past[0].shape[-2]), 0

    def get_seq_length(self) -> int:
        return 0

    def get_max_length(self) -> int:
        return int(self.past[0].shape[-2])


class RetainedCache(Cache):
    """The model's ``past_key_values``: one :class:`RetainedLayer` per decoder layer."""

    def __init__(self, past: list[torch.Tensor], step: Any) -> None:
        layers: list[Any] = [RetainedLayer(past[2 * i], past[2 * i + 1], step) for i in range(len(past) // 2)]
        super().__init__(layers=layers)

    def retained_states(self) -> list[torch.Tensor]:
        """``past_key.0_RetainedState, past_value.0_RetainedState, ...`` in contract order."""
        out: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, RetainedLayer) or layer.retained is None:
                raise RuntimeError(f"decoder layer {i} did not write its KV cache during the traced step")
            out.extend(layer.retained)
        return out
