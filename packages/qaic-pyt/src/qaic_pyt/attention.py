"""The eager path's attention for vLLM's model classes: plain torch over vLLM's paged KV blocks.

The KV cache of each layer is one tensor ``[2, num_blocks, block_size, num_kv_heads, head_size]``
(keys then values; vLLM's flash block layout). vLLM's ``Attention`` layer first writes the step's
keys and values to their slots (:meth:`QaicPagedAttentionImpl.do_kv_cache_update`), then asks for
attention: every query attends to its own sequence's cached positions up to itself (and, for a
layer with a sliding window, no further back than the window). Decodes (one query each) run as
one batched SDPA call; prefill chunks run one sequence at a time. Logit soft-capping (Gemma 2)
and grouped-query heads are supported; ALiBi, attention sinks and encoder attention are refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

CLASS_PATH = "qaic_pyt.attention.QaicPagedAttentionBackend"


class QaicPagedAttentionBackend(AttentionBackend):
    """vLLM's view of the backend: names, KV layout and the classes that do the work."""

    accept_output_buffer: bool = True
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[QaicPagedAttentionImpl]:
        return QaicPagedAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[QaicPagedMetadataBuilder]:
        return QaicPagedMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, cache_dtype_str: str = "auto"
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @staticmethod
    def use_cascade_attention(*args: Any, **kwargs: Any) -> bool:
        return False


@dataclass
class QaicPagedMetadata(AttentionMetadata):
    """One step's attention metadata, shared by every layer."""

    num_actual_tokens: int
    query_start_loc: list[int]
    """``[num_seqs + 1]`` offsets of each sequence's queries in the flattened batch."""
    seq_lens: list[int]
    """Tokens of each sequence after the step (the positions its attention reads)."""
    block_table: torch.Tensor
    """``[num_seqs, max_blocks]`` block ids (int64, on the KV cache's device)."""
    slot_mapping: torch.Tensor
    """``[num_actual_tokens]`` cache slot (block * block_size + offset) of each token."""
    decode_rows: list[int]
    """Sequences with a single query (batched together)."""
    other_rows: list[int]
    """Sequences with several queries (prefill chunks), run one at a time."""


class QaicPagedMetadataBuilder(AttentionMetadataBuilder[QaicPagedMetadata]):
    """Turns vLLM's common metadata into :class:`QaicPagedMetadata`."""

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> QaicPagedMetadata:
        cm = common_attn_metadata
        starts = [int(x) for x in cm.query_start_loc_cpu.tolist()]
        seq_lens = [int(x) for x in cm.seq_lens.cpu().tolist()]
        query_lens = [starts[i + 1] - starts[i] for i in range(cm.num_reqs)]
        return QaicPagedMetadata(
            num_actual_tokens=int(cm.num_actual_tokens),
            query_start_loc=starts,
            seq_lens=seq_lens,
            block_table=cm.block_table_tensor.to(torch.int64),
            slot_mapping=cm.slot_mapping.to(torch.int64),
            decode_rows=[i for i, n in enumerate(query_lens) if n == 1],
            other_rows=[i for i, n in enumerate(query_lens) if n > 1],
        )


class QaicPagedAttentionImpl(AttentionImpl[QaicPagedMetadata]):
    """Writes the step's keys and values into their blocks and attends over each sequence's blocks."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        **extra: Any,
    ) -> None:
        if alibi_slopes is not None:
            raise NotImplementedError("ALiBi attention is not supported on the qaic pyt path")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"{attn_type} attention is not supported on the qaic pyt path")
        if extra.get("sinks") is not None:
            raise NotImplementedError("attention sinks are not supported on the qaic pyt path")
        if kv_cache_dtype not in ("auto", "float16", "bfloat16", "float32"):
            raise NotImplementedError(
                f"--kv-cache-dtype {kv_cache_dtype} is not supported on the qaic pyt path: use auto"
            )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.sliding_window = sliding_window
        self.logits_soft_cap = float(logits_soft_cap or 0.0)
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name

    # -- the cache -----------------------------------------------------------------------------
    def do_kv_cache_update(
        self,
        layer: Any,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Store each token's key and value at its slot."""
        if kv_cache.numel() == 0:
            return
        n = slot_mapping.shape[0]
        keys = kv_cache[0].view(-1, self.num_kv_heads, self.head_size)
        values = kv_cache[1].view(-1, self.num_kv_heads, self.head_size)
        slots = slot_mapping.to(torch.int64)
        keys.index_copy_(0, slots, key[:n].to(keys.dtype))
        values.index_copy_(0, slots, value[:n].to(values.dtype))

    # -- attention -----------------------------------------------------------------------------
    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: QaicPagedMetadata,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported on the qaic pyt path")
        if attn_metadata is None:  # a run without a cache (vLLM's profiling): nothing to attend to
            return output
        md = attn_metadata
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        if md.decode_rows:
            self._decodes(query, key_cache, value_cache, md, output)
        for row in md.other_rows:
            self._sequence(row, query, key_cache, value_cache, md, output)
        return output

    def _decodes(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        md: QaicPagedMetadata,
        output: torch.Tensor,
    ) -> None:
        """Every single-query sequence at once, each over its own (padded) context."""
        rows = md.decode_rows
        device = query.device
        block_size = key_cache.shape[1]
        starts = torch.tensor([md.query_start_loc[r] for r in rows], dtype=torch.int64, device=device)
        lens = torch.tensor([md.seq_lens[r] for r in rows], dtype=torch.int64, device=device)
        num_blocks = -(-max(md.seq_lens[r] for r in rows) // block_size)
        tables = md.block_table[torch.tensor(rows, dtype=torch.int64, device=device), :num_blocks]
        keys = self._gather(key_cache, tables)  # [B, Hkv, L, D]
        values = self._gather(value_cache, tables)
        positions = torch.arange(keys.shape[2], device=device)
        visible = positions[None, :] < lens[:, None]
        if self.sliding_window is not None:
            visible &= positions[None, :] >= (lens[:, None] - self.sliding_window)
        q = query[starts].unsqueeze(2)  # [B, H, 1, D]
        out = self._attend(q, keys, values, visible[:, None, None, :])
        output[starts] = out[:, :, 0, :].to(output.dtype)

    def _sequence(
        self,
        row: int,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        md: QaicPagedMetadata,
        output: torch.Tensor,
    ) -> None:
        """One sequence's chunk of queries over its context, causal within the chunk."""
        start, end = md.query_start_loc[row], md.query_start_loc[row + 1]
        seq_len = md.seq_lens[row]
        device = query.device
        block_size = key_cache.shape[1]
        num_blocks = -(-seq_len // block_size)
        tables = md.block_table[row : row + 1, :num_blocks]
        keys = self._gather(key_cache, tables)[:, :, :seq_len]
        values = self._gather(value_cache, tables)[:, :, :seq_len]
        key_pos = torch.arange(seq_len, device=device)
        query_pos = torch.arange(seq_len - (end - start), seq_len, device=device)
        visible = key_pos[None, :] <= query_pos[:, None]
        if self.sliding_window is not None:
            visible &= key_pos[None, :] > (query_pos[:, None] - self.sliding_window)
        q = query[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        out = self._attend(q, keys, values, visible[None, None])
        output[start:end] = out[0].transpose(0, 1).to(output.dtype)

    @staticmethod
    def _gather(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """``[B, blocks]`` block ids -> ``[B, heads, blocks * block_size, head_size]``."""
        blocks = cache[tables]  # [B, nb, bs, H, D]
        b, nb, bs, h, d = blocks.shape
        return blocks.reshape(b, nb * bs, h, d).transpose(1, 2)

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor
    ) -> torch.Tensor:
        """Scaled dot-product attention of ``q [B, H, n, D]`` over ``k, v [B, Hkv, L, D]``."""
        k = k.to(q.dtype)
        v = v.to(q.dtype)
        if not self.logits_soft_cap:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=visible, scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads
            )
        group = self.num_heads // self.num_kv_heads
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * self.scale
        cap = self.logits_soft_cap
        scores = torch.tanh(scores / cap) * cap
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return torch.matmul(probs, v.float()).to(q.dtype)


register_backend(AttentionBackendEnum.CUSTOM, CLASS_PATH)  # vLLM's layers name their backend by enum member
