"""What every traced layer shares in one step: the raw positions, the KV rows and the attention masks."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from qaic_aot.export import contract
from qaic_aot.export.traced import kv

_CURRENT: ContextVar[Step | None] = ContextVar("qaic_traced_step", default=None)


class Step:
    """One program step: ``position_ids`` as given (-1 is padding), ``batch_index`` with continuous batching.

    Attention reads the first ``ctx_len`` cache positions: the whole cache, or the compute-context
    length (the length of ``comp_ctx_lengths``) when the program has one.
    """

    def __init__(self, position_ids: torch.Tensor, batch_index: torch.Tensor | None, ctx_len: int):
        self.position_ids = position_ids
        self.batch_index = batch_index
        self.kv_positions = torch.arange(ctx_len, dtype=torch.int64)
        self._masks: dict[int | None, torch.Tensor] = {}

    def scatter(self, past: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """Write the new keys or values at their positions: the retained state."""
        if self.batch_index is not None:
            return kv.CtxScatterCB.apply(past, self.batch_index, self.position_ids, new)
        return kv.CtxScatter.apply(past, self.position_ids, new)

    def gather(self, kept: torch.Tensor) -> torch.Tensor:
        """The whole context of this step's rows, [batch, heads, ctx_len, head_dim]."""
        indices = self.kv_positions.reshape(1, 1, -1)
        if self.batch_index is not None:
            return kv.CtxGatherCB.apply(kept, self.batch_index, indices)
        return kv.CtxGather.apply(kept, indices)

    def mask(self, sliding_window: int | None = None) -> torch.Tensor:
        """Additive mask [batch, 1, seq_len, ctx_len]: key j is hidden from a query at p when j > p
        (or j <= p - sliding_window)."""
        key = int(sliding_window) if sliding_window else None
        if key not in self._masks:
            query = self.position_ids.unsqueeze(-1)  # [B, S, 1]
            hidden = self.kv_positions > query
            if key is not None:
                hidden = hidden | (self.kv_positions <= query - key)
            additive = torch.where(hidden, contract.MASKED_SCORE, 0.0).to(torch.float32)
            self._masks[key] = additive.unsqueeze(1)
        return self._masks[key]

    def last_indices(self, num_logits_to_keep: torch.Tensor | None) -> torch.Tensor:
        """Sequence index of the last real token of each row ([B, 1]), or the last K+1 up to it."""
        last = self.position_ids.to(torch.int32).argmax(dim=1, keepdim=True).to(torch.int64)
        if num_logits_to_keep is None:
            return last
        keep = num_logits_to_keep.shape[0]
        span = torch.arange(keep, dtype=torch.int64).reshape(1, -1)
        return (last - (keep - 1) + span).clamp(min=0)


@contextmanager
def active(step: Step) -> Iterator[Step]:
    """Make ``step`` the one the attention function and LM head of the traced model read."""
    token = _CURRENT.set(step)
    try:
        yield step
    finally:
        _CURRENT.reset(token)


def current() -> Step:
    step = _CURRENT.get()
    if step is None:
        raise RuntimeError("the qaic attention runs only inside a traced export step")
    return step
