"""What one eager step costs: a flattened batch of prefill chunks and decodes over a paged KV cache.

The same roofline as compiled programs (:mod:`qaic_sim.timing`), with the eager path's shapes:
tokens are the batch's scheduled tokens, and attention reads each sequence's own context (its
``seq_len``) instead of a static ``ctx_len`` window. Host dispatch of the individual operators is
not modelled (the card's eager runtime publishes no figure for it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from qaic_sim.mx import bytes_per_element
from qaic_sim.timing_cost import ProgramCost, side_bytes_per_element
from qaic_sim.timing_shape import DecoderShape


def eager_step_cost(
    config: Mapping[str, Any] | Any,
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    num_logits: int,
    *,
    weight_precision: str = "float16",
    kv_precision: str = "float16",
) -> ProgramCost:
    """FLOPs and bytes of one eager step; raises ValueError for a config the model cannot size."""
    if len(query_lens) != len(seq_lens):
        raise ValueError(f"{len(query_lens)} query lengths for {len(seq_lens)} sequences")
    if any(q < 0 or s < q for q, s in zip(query_lens, seq_lens, strict=True)):
        raise ValueError("each sequence needs 0 <= query_len <= seq_len")
    s = DecoderShape.from_config(config)
    wb, kvb = bytes_per_element(weight_precision), bytes_per_element(kv_precision)
    side = side_bytes_per_element(wb)
    tokens = int(sum(query_lens))
    h, layers = s.hidden_size, s.num_layers
    q_out = s.num_heads * s.head_dim
    kv_out = s.num_kv_heads * s.head_dim
    experts_read = min(s.num_experts, tokens * s.experts_per_token) if s.num_experts else 1
    experts_used = s.experts_per_token if s.num_experts else 1
    router = h * s.num_experts
    layer_read = s.attention_params + experts_read * s.expert_params + router
    layer_used = s.attention_params + experts_used * s.expert_params + router
    lm_head = h * s.vocab_size
    bias = (q_out + 2 * kv_out + h if s.attention_bias else 0) + (
        experts_read * (s.intermediate_size + h) if s.mlp_bias else 0
    )
    norms = 2 * h
    pairs = sum(q * k for q, k in zip(query_lens, seq_lens, strict=True))
    attention_flops = 4 * s.num_heads * s.head_dim * pairs  # QK^T and PV over each sequence's own context
    flops = layers * (2 * tokens * layer_used + attention_flops) + 2 * num_logits * lm_head
    weight_bytes = (layers * layer_read + lm_head) * wb + (layers * (bias + norms) + h + tokens * h) * side
    kv_per_token = s.kv_elements_per_token * kvb
    tied = bool(
        config.get("tie_word_embeddings", True)
        if isinstance(config, Mapping)
        else getattr(config, "tie_word_embeddings", True)
    )
    storage = (
        layers * (s.attention_params + max(s.num_experts, 1) * s.expert_params + router) + lm_head
    ) * wb
    storage += (layers * (bias + norms) + h + (0 if tied else lm_head)) * side
    return ProgramCost(
        flops=float(flops),
        weight_bytes=float(weight_bytes) if tokens else 0.0,
        kv_read_bytes=float(sum(seq_lens) * kv_per_token),
        kv_write_bytes=float(tokens * kv_per_token),
        activation_bytes=float(2 * tokens * 8 + num_logits * s.vocab_size * 4),
        tokens=max(tokens, 1),
        weight_storage_bytes=float(storage),
        kv_storage_bytes=float(sum(seq_lens) * kv_per_token),
    )
