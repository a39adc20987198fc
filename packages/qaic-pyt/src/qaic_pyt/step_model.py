"""The ``pyt`` execution path: vLLM's own model class run eagerly over a paged KV cache.

:func:`open_step_model` loads the architecture's vLLM model class with vLLM's loader from a local
Hugging Face directory onto the eager device (the simulator's accounted CPU tensors, or the card's
``qaic`` device), its attention layers using :mod:`qaic_pyt.attention`. The serving framework
then sizes the KV cache (:attr:`EagerStepModel.memory`), has it allocated in vLLM's block layout
(:meth:`EagerStepModel.allocate_kv`) and runs steps of prefill chunks and decodes flattened into
one batch (:meth:`EagerStepModel.submit_batch`), each wrapped by the device layer's step accounting.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import torch

from qaic_core.eager import DeviceMemoryError, EagerDevice, EagerDeviceRequest, EagerStep
from qaic_core.errors import QaicConfigError
from qaic_core.execution import (
    PAGED_KV,
    PREFIX_CACHING,
    DeviceMemory,
    ExecutionConfig,
    PagedBatch,
    PagedKVSpec,
    StepShape,
)
from qaic_pyt import memory, ops
from qaic_pyt.device import open_device

log = logging.getLogger("qaic.pyt")

WEIGHTS = "weights"
KV_CACHE = "kv cache"


class Done:
    """A step that already ran (eager steps complete before ``submit_batch`` returns)."""

    def __init__(self, value: np.ndarray) -> None:
        self.value = value

    def wait(self) -> np.ndarray:
        return self.value


def vllm_config_of(config: ExecutionConfig) -> Any:
    vllm_config = config.options.vllm_config
    if vllm_config is None:
        raise QaicConfigError(
            "the pyt execution path runs vLLM's model classes: pass vLLM's config as "
            "ExecutionConfig(options=OpenOptions(vllm_config=...))"
        )
    return vllm_config


def device_request(config: ExecutionConfig, hf_config: Any, dtype: torch.dtype) -> EagerDeviceRequest:
    to_dict = getattr(hf_config, "to_dict", None)
    return EagerDeviceRequest(
        model_config=to_dict() if callable(to_dict) else dict(hf_config),
        device_group=config.settings.device_group,
        weight_dtype=memory.dtype_name(dtype),
        kv_dtype=memory.dtype_name(dtype),
        label=config.model_dir.name,
    )


class EagerStepModel:
    """A loaded vLLM model on an eager device, stepped as a :class:`~qaic_core.execution.PagedStepModel`."""

    def __init__(
        self,
        vllm_config: Any,
        model: torch.nn.Module,
        device: EagerDevice,
        weight_bytes: int,
        reload_weights: Callable[[], None] | None = None,
    ) -> None:
        self.vllm_config = vllm_config
        self.model = model
        self.reload_weights = reload_weights
        """Reads the weights into ``model`` again (the model loader's ``reload``); None: it cannot."""
        self.device = device
        self.torch_device = torch.device(device.torch_device)
        self.weight_bytes = weight_bytes
        self.dtype: torch.dtype = vllm_config.model_config.dtype
        self.layers = _attention_layers(vllm_config)
        first = next(iter(self.layers.values()))
        self.num_kv_heads = int(first.num_kv_heads)
        self.head_size = int(first.head_size)
        for name, layer in self.layers.items():
            if (int(layer.num_kv_heads), int(layer.head_size), int(layer.head_size_v)) != (
                self.num_kv_heads,
                self.head_size,
                self.head_size,
            ):
                raise QaicConfigError(
                    f"attention layer {name} has a KV shape unlike the first layer's: the pyt path keeps one "
                    "KV shape for every layer"
                )
        self.block_size = int(vllm_config.cache_config.block_size)
        sched = vllm_config.scheduler_config
        self._shape = StepShape(
            num_slots=int(sched.max_num_seqs),
            prefill_seq_len=int(sched.max_num_batched_tokens),
            ctx_len=int(vllm_config.model_config.max_model_len),
            vocab_size=int(vllm_config.model_config.get_vocab_size()),
        )
        self._kv_spec = PagedKVSpec(
            num_layers=len(self.layers),
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            block_size=self.block_size,
            dtype=memory.dtype_name(self.dtype),
        )
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.num_blocks = 0
        builder_cls = first.attn_backend.get_builder_cls()
        self.builder = builder_cls(None, list(self.layers), vllm_config, self.torch_device)

    # -- what the framework reads ----------------------------------------------------------------
    @property
    def shape(self) -> StepShape:
        return self._shape

    @property
    def capabilities(self) -> frozenset[str]:
        return frozenset({PAGED_KV, PREFIX_CACHING})

    @property
    def kv_spec(self) -> PagedKVSpec:
        return self._kv_spec

    @property
    def memory(self) -> DeviceMemory:
        return DeviceMemory(
            total_bytes=self.device.total_bytes(),
            model_bytes=self.weight_bytes,
            free_bytes=self.device.free_bytes(),
        )

    def block_bytes(self) -> int:
        """Bytes of one KV block over every layer."""
        item = torch.empty((), dtype=self.dtype).element_size()
        return 2 * len(self.layers) * self.block_size * self.num_kv_heads * self.head_size * item

    # -- the KV cache ----------------------------------------------------------------------------
    def allocate_kv(self, num_blocks: int) -> None:
        """``[2, num_blocks, block_size, kv_heads, head_size]`` per layer, bound to its attention layer."""
        if num_blocks < 1:
            raise QaicConfigError(f"the KV cache needs at least one block, got {num_blocks}")
        self._free_kv()
        self.device.reserve(KV_CACHE, num_blocks * self.block_bytes())
        backend = next(iter(self.layers.values())).attn_backend
        shape = backend.get_kv_cache_shape(num_blocks, self.block_size, self.num_kv_heads, self.head_size)
        for name, layer in self.layers.items():
            cache = torch.zeros(shape, dtype=self.dtype, device=self.torch_device)
            self.kv_caches[name] = cache
            layer.kv_cache = cache
        self.num_blocks = num_blocks
        log.info(
            "qaic: KV cache of %d blocks x %d tokens (%s) on %s",
            num_blocks,
            self.block_size,
            memory.mb(num_blocks * self.block_bytes()),
            self.device.name,
        )

    def _free_kv(self) -> None:
        for layer in self.layers.values():
            layer.kv_cache = torch.tensor([])
        self.kv_caches.clear()
        self.device.release(KV_CACHE)
        self.num_blocks = 0

    # -- steps -----------------------------------------------------------------------------------
    def submit_batch(self, batch: PagedBatch) -> Done:
        """Run one step now; the logits of the rows in ``batch.logits_indices`` (float32)."""
        if not self.kv_caches:
            raise RuntimeError("allocate_kv() must run before the first step")
        work = EagerStep(
            query_lens=list(batch.query_lens),
            seq_lens=list(batch.seq_lens),
            num_logits=len(batch.logits_indices),
        )
        with self.device.step(work), torch.inference_mode():
            return Done(self._run(batch))

    def _run(self, batch: PagedBatch) -> np.ndarray:
        from vllm.forward_context import set_forward_context
        from vllm.v1.attention.backend import CommonAttentionMetadata

        dev = self.torch_device
        for source, target in batch.block_copies:
            for cache in self.kv_caches.values():
                cache[:, target].copy_(cache[:, source])
        positions_np = np.asarray(batch.positions, dtype=np.int64)
        query_lens = np.asarray(batch.query_lens, dtype=np.int64)
        num_tokens = int(query_lens.sum())
        starts = np.zeros(len(query_lens) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=starts[1:])
        width = max((len(t) for t in batch.block_tables), default=1) or 1
        tables = np.zeros((len(batch.block_tables), width), dtype=np.int64)
        for i, table in enumerate(batch.block_tables):
            tables[i, : len(table)] = table
        owner = np.repeat(np.arange(len(query_lens)), query_lens)
        blocks = tables[owner, positions_np // self.block_size]
        slots = blocks * self.block_size + positions_np % self.block_size
        slot_mapping = torch.from_numpy(slots).to(dev)
        seq_lens = torch.tensor(list(batch.seq_lens), dtype=torch.int32)
        common = CommonAttentionMetadata(
            query_start_loc=torch.from_numpy(starts).to(dev),
            query_start_loc_cpu=torch.from_numpy(starts),
            seq_lens=seq_lens.to(dev),
            num_reqs=len(query_lens),
            num_actual_tokens=num_tokens,
            max_query_len=int(query_lens.max(initial=0)),
            max_seq_len=int(max(batch.seq_lens, default=0)),
            block_table_tensor=torch.from_numpy(tables).to(dev),
            slot_mapping=slot_mapping,
        )
        metadata = self.builder.build(0, common)
        input_ids = torch.from_numpy(np.asarray(batch.input_ids, dtype=np.int64)).to(dev)
        positions = torch.from_numpy(positions_np).to(dev)
        with set_forward_context(
            {name: metadata for name in self.layers},
            self.vllm_config,
            num_tokens=num_tokens,
            slot_mapping={name: slot_mapping for name in self.layers},
        ):
            hidden = self.model(input_ids=input_ids, positions=positions)
        rows = torch.tensor(list(batch.logits_indices), dtype=torch.int64, device=dev)
        logits = self.model.compute_logits(hidden[rows])  # type: ignore[operator]
        return np.ascontiguousarray(logits.to(torch.float32).cpu().numpy())

    # -- after a device fault --------------------------------------------------------------------
    def recover(self) -> None:
        """Bring the device back after a failed step: weights placed again, every KV block emptied.

        A reset loses what the device held (on a card the tensors on its ``qaic`` device; on the
        simulator its accounting, after which steps fail until the memory is held again), and the
        layer cannot tell a reset from a fault that kept memory, so the model loader reads the weights
        in again (its ``reload``) and the KV cache is allocated afresh. Raises when the loader cannot
        reload or the device cannot hold them again (the runner then stops the engine).
        """
        if not self.kv_caches:
            raise RuntimeError("recover() needs a model whose KV cache was allocated")
        if self.reload_weights is None:
            raise RuntimeError(
                "the model loader that opened this model cannot reload its weights after a device fault "
                "(its ModelLoader has no reload); restart the server, or use a loader that has one"
            )
        num_blocks = self.num_blocks
        self._free_kv()
        self.device.release(WEIGHTS)
        self.device.settle(WEIGHTS, self.weight_bytes)
        self.reload_weights()
        self.allocate_kv(num_blocks)
        log.warning(
            "qaic: %s recovered: weights loaded again, %d KV blocks emptied", self.device.name, num_blocks
        )

    def close(self) -> None:
        self._free_kv()
        self.device.close()
        self.model = torch.nn.Module()


def _attention_layers(vllm_config: Any) -> dict[str, Any]:
    from vllm.model_executor.layers.attention.attention import Attention

    layers = {
        name: layer
        for name, layer in vllm_config.compilation_config.static_forward_context.items()
        if isinstance(layer, Attention)
    }
    if not layers:
        raise QaicConfigError("the model has no attention layers the pyt path can give a KV cache")
    return layers


def open_step_model(config: ExecutionConfig) -> EagerStepModel:
    """Load the model with the selected model loader (``vllm``: vLLM's loader) onto the eager device,
    its weights accounted first."""
    from qaic_core import get_plugin_manager
    from qaic_pyt.plugin import LOADER_KINDS

    loader = get_plugin_manager().select_model_loader(config, LOADER_KINDS, "pyt")
    vllm_config = vllm_config_of(config)
    model_config = vllm_config.model_config
    dtype: torch.dtype = model_config.dtype
    hf_config = model_config.hf_config
    device = open_device(config.device, device_request(config, hf_config, dtype))
    try:
        estimate = memory.weight_bytes(hf_config, dtype)
        if estimate is not None:
            _reserve_weights(device, config, estimate, settle=False)
        ops.install(cpu=torch.device(device.torch_device).type == "cpu")
        vllm_config.load_config.device = device.torch_device
        start = time.perf_counter()
        model = loader.load(config)
        if not isinstance(model, torch.nn.Module):
            raise QaicConfigError(
                f"model loader {loader.name!r} ({loader.package}) returned a {type(model).__name__}, "
                "not the torch.nn.Module the pyt path runs: fix the plugin or name another loader"
            )
        model.eval()
        actual = memory.module_bytes(model)
        _reserve_weights(device, config, actual, settle=True)
        log.info(
            "qaic: %s loaded eagerly on %s in %.1fs (weights %s, %s)",
            config.model_dir.name,
            device.name,
            time.perf_counter() - start,
            memory.mb(actual),
            memory.dtype_name(dtype),
        )
        reload = loader.reload
        reload_weights = None if reload is None else partial(reload, config, model)
        return EagerStepModel(vllm_config, model, device, actual, reload_weights)
    except BaseException:
        device.close()
        raise


def _reserve_weights(device: EagerDevice, config: ExecutionConfig, nbytes: int, *, settle: bool) -> None:
    try:
        if settle:
            device.settle(WEIGHTS, nbytes)
        else:
            device.reserve(WEIGHTS, nbytes)
    except DeviceMemoryError as exc:
        raise QaicConfigError(weights_do_not_fit(exc, config)) from exc


def weights_do_not_fit(exc: DeviceMemoryError, config: ExecutionConfig) -> str:
    hints = []
    if config.dtype == "float32":
        hints.append("--dtype float16 (half the bytes)")
    hints += ["a smaller model", "a card with more DDR per SoC (QAIC_SIM_TOPOLOGY on the simulator)"]
    hints.append("or the aot execution mode with --quantization mxfp6")
    return (
        f"{config.model_dir.name} does not fit the device in the pyt (eager) mode: {exc}; use "
        + ", ".join(hints)
    )
