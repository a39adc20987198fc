"""The vLLM worker for execution paths with a paged KV cache (``pyt``): vLLM's own KV block layout.

The device set-up and tracing are :class:`~qaic_vllm.worker.base.QaicWorkerBase`'s; this worker opens a :class:`~qaic_core.execution.PagedStepModel`, reports one full-attention KV spec
per layer so vLLM's KV cache manager (prefix caching, preemption) runs unchanged, sizes the cache
from the device memory left after the weights, and steps the model with a
:class:`~qaic_vllm.runner.paged.PagedModelRunner`.
"""

from __future__ import annotations

import logging

import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheSpec

from qaic_core.eager import DeviceMemoryError
from qaic_core.errors import QaicConfigError
from qaic_core.execution import OpenOptions, PagedStepModel
from qaic_vllm.runner.paged import PagedModelRunner
from qaic_vllm.worker.base import QaicWorkerBase

log = logging.getLogger("qaic.vllm.worker")

KV_LAYER = "qaic.paged_kv.{}"
KV_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class QaicPagedWorker(QaicWorkerBase):
    """One worker per SoC; the model's KV cache lives in blocks vLLM's scheduler hands out."""

    paged_model: PagedStepModel | None = None

    def open_model(self) -> PagedModelRunner:
        """Open the paged step model: the execution path loads the weights onto its device."""
        assert self.path is not None
        model = self.open_path(self.execution_config(OpenOptions(vllm_config=self.vllm_config)))
        if not isinstance(model, PagedStepModel):
            self.refuse(
                model, "a slot-layout model for the paged worker", "its descriptor must not claim paged_kv"
            )
        self.paged_model = model
        return PagedModelRunner(self.vllm_config, model)

    def _model(self) -> PagedStepModel:
        assert self.paged_model is not None, "load_model() must run first"
        return self.paged_model

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        """One full-attention spec per layer (sliding windows are applied by the attention itself)."""
        spec = self._model().kv_spec
        layer = FullAttentionSpec(
            block_size=spec.block_size,
            num_kv_heads=spec.num_kv_heads,
            head_size=spec.head_size,
            dtype=KV_DTYPES[spec.dtype],
        )
        return {KV_LAYER.format(i): layer for i in range(spec.num_layers)}

    def block_bytes(self) -> int:
        spec = self._model().kv_spec
        layer = next(iter(self.get_kv_cache_spec().values()))
        return int(layer.page_size_bytes) * spec.num_layers

    def determine_available_memory(self) -> int:
        """KV bytes: what the device has free, capped at what --max-num-seqs full-length sequences need.

        ``--kv-cache-memory-bytes`` sets it outright; ``--gpu-memory-utilization`` is the share of
        the device's DDR the engine may hold (weights included). A cache that cannot hold one
        ``--max-model-len`` sequence fails here naming the fix.
        """
        model = self._model()
        mem = model.memory
        spec = model.kv_spec
        cache = self.vllm_config.cache_config
        block = self.block_bytes()
        blocks_per_seq = -(-int(self.model_config.max_model_len) // spec.block_size)
        wanted = (int(self.vllm_config.scheduler_config.max_num_seqs) * blocks_per_seq + 1) * block
        utilization = float(cache.gpu_memory_utilization or 0.9)
        budget = min(mem.free_bytes, int(mem.total_bytes * utilization) - mem.model_bytes)
        explicit = cache.kv_cache_memory_bytes
        available = int(explicit) if explicit else min(budget, wanted)
        if available < (blocks_per_seq + 1) * block:
            raise QaicConfigError(
                f"the KV cache for one {self.model_config.max_model_len}-token sequence needs "
                f"{(blocks_per_seq + 1) * block / 2**20:.1f} MB but {max(available, 0) / 2**20:.1f} MB of the "
                f"device's {mem.total_bytes / 2**20:.0f} MB are left after the weights "
                f"({mem.model_bytes / 2**20:.1f} MB): lower --max-model-len, use --dtype float16, raise "
                "--gpu-memory-utilization, or use a card with more DDR per SoC"
            )
        log.info(
            "qaic: %.1f MB for the KV cache (%d blocks of %d tokens); %.1f MB free on the device",
            available / 2**20,
            available // block,
            spec.block_size,
            mem.free_bytes / 2**20,
        )
        return available

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        try:
            self._model().allocate_kv(int(kv_cache_config.num_blocks))
        except DeviceMemoryError as exc:
            raise QaicConfigError(
                f"{exc}: lower --num-gpu-blocks-override or --kv-cache-memory-bytes, or --max-num-seqs / "
                "--max-model-len"
            ) from exc

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def shutdown(self) -> None:
        super().shutdown()
        self.paged_model = None
