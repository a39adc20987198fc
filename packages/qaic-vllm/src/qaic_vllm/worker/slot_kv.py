"""The KV bookkeeping of workers whose KV lives in device slots: vLLM only counts one block per sequence."""

from __future__ import annotations

import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheSpec

from qaic_vllm.worker.base import QaicWorkerBase


class SlotKVWorker(QaicWorkerBase):
    """A stand-in KV layer of one ``max_model_len`` block per sequence: the real KV lives on the device."""

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        """One tiny stand-in layer: the real KV lives on the device; vLLM only counts slots."""
        block_size = int(self.model_config.max_model_len)
        return {
            "qaic.kv": FullAttentionSpec(
                block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float16
            )
        }

    def get_supported_kv_cache_layouts(self) -> list[str]:
        from vllm.v1.kv_cache_layout import KVCacheLayout

        return [layout.name for layout in KVCacheLayout]

    def determine_available_memory(self) -> int:
        spec = self.get_kv_cache_spec()["qaic.kv"]
        return int(spec.page_size_bytes * (self.settings.compile.decode_batch_size + 2))

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        self.check_blocks(kv_cache_config)

    def check_blocks(self, kv_cache_config: KVCacheConfig) -> None:
        """vLLM must hand out a block per slot, and the null block."""
        blocks = int(kv_cache_config.num_blocks)
        if blocks < self.settings.compile.decode_batch_size + 1:
            raise RuntimeError(
                f"vLLM allotted {blocks} KV blocks; Cloud AI needs max_num_seqs + 1 = "
                f"{self.settings.compile.decode_batch_size + 1}"
            )
