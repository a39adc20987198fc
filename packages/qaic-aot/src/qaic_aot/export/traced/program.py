"""The traced program: a transformers causal LM called with QEfficient's IO contract."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from qaic_aot.export.traced import step as steps
from qaic_aot.export.traced.kv import RetainedCache


class LastTokenHead(nn.Module):
    """The model's LM head applied only to the hidden states whose logits the program returns."""

    def __init__(self, head: nn.Module, step_source: CausalLMProgram) -> None:
        super().__init__()
        self.head = head
        self._program = [step_source]  # a list: not registered as a submodule

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        indices = self._program[0].logit_indices
        assert indices is not None
        picked = torch.gather(hidden, 1, indices.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
        return self.head(picked)


class CausalLMProgram(nn.Module):
    """``forward(input_ids, position_ids, past_key.0, ..., [comp_ctx_lengths], [batch_index], [num_logits_to_keep])``."""

    def __init__(
        self,
        model: nn.Module,
        num_layers: int,
        continuous_batching: bool,
        speculative: bool,
        ccl: bool = False,
    ) -> None:
        super().__init__()
        self.model = model
        self.num_layers = num_layers
        self.continuous_batching = continuous_batching
        self.speculative = speculative
        self.ccl = ccl
        self.logit_indices: torch.Tensor | None = None
        name, head = _lm_head(model)
        setattr(model, name, LastTokenHead(head, self))

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, *rest: torch.Tensor
    ) -> tuple[Any, ...]:
        past = list(rest[: 2 * self.num_layers])
        extra = list(rest[2 * self.num_layers :])
        ccl = extra.pop(0) if self.ccl else None
        batch_index = extra.pop(0) if self.continuous_batching else None
        keep = extra.pop(0) if self.speculative else None
        context = ccl.shape[0] if ccl is not None else past[0].shape[2]
        step = steps.Step(position_ids, batch_index, context)
        cache = RetainedCache(past, step)
        self.logit_indices = step.last_indices(keep)
        with steps.active(step):
            out = self.model(
                input_ids=input_ids,
                position_ids=position_ids.clamp(min=0),
                attention_mask=step.mask(None),
                past_key_values=cache,
                use_cache=True,
                return_dict=True,
            )
        self.logit_indices = None
        return (out.logits, *cache.retained_states())


def _lm_head(model: nn.Module) -> tuple[str, nn.Module]:
    """The attribute name and module of the output embeddings (``lm_head`` in most families)."""
    head = model.get_output_embeddings()  # type: ignore[operator]
    for name, child in model.named_children():
        if child is head:
            return name, child
    raise ValueError(f"{type(model).__name__}: cannot find the LM head among its direct submodules")
