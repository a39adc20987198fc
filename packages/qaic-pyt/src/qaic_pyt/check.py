"""Configuration-time checks of the ``pyt`` path: what only compiled programs do, and whether the model fits."""

from __future__ import annotations

import logging
from typing import Any

from qaic_core.eager import DeviceMemoryError
from qaic_core.errors import QaicConfigError
from qaic_core.execution import ExecutionConfig
from qaic_core.settings import CompileSettings
from qaic_pyt import memory

log = logging.getLogger("qaic.pyt")

MODE = "the pyt (eager) execution mode"
DEFAULT_BLOCK_SIZE = 16


def aot_only_features(settings: CompileSettings, qpc_path: object) -> list[str]:
    """What the settings ask for that only a compiled program (the aot mode) has.

    Compiler settings (cores, ``-mos``, depth-first, extra flags) have defaults the caller fills
    in, so only the caller knows whether they were asked for: it refuses those itself.
    """
    found = []
    if settings.mxfp6:
        found.append("mxfp6 weights (--quantization mxfp6)")
    if settings.mxint8:
        found.append("an mxint8 KV cache (--kv-cache-dtype mxint8 / fp8)")
    if qpc_path is not None:
        found.append("a prebuilt program (qpc_path / VLLM_QAIC_QPC_PATH)")
    return found


def check(config: ExecutionConfig) -> None:
    """Refuse AOT-only features and multi-SoC groups; fail when the model cannot fit the device."""
    settings = config.settings
    found = aot_only_features(settings, config.qpc_path)
    if found:
        raise QaicConfigError(
            f"{MODE} runs vLLM's model classes without compiling a program, so it has no "
            f"{'; no '.join(found)}: drop them or choose the aot execution mode"
        )
    if settings.num_devices > 1 or (settings.device_group is not None and len(settings.device_group) > 1):
        group = list(settings.device_group) if settings.device_group else settings.num_devices
        raise QaicConfigError(
            f"tensor parallelism across SoCs ({group}) is not supported in {MODE}: run on one SoC "
            "(one device in device_group) or choose the aot execution mode, whose compiler slices the model"
        )
    if settings.num_speculative_tokens:
        raise QaicConfigError(
            f"speculative decoding is not supported in {MODE}: choose the aot execution mode"
        )
    check_memory(config)


def check_memory(config: ExecutionConfig) -> None:
    """The weights and one full-length sequence's KV cache must fit the free DDR of the device."""
    from qaic_pyt.device import open_device
    from qaic_pyt.step_model import device_request

    hf_config, dtype_name, block_size = _model_facts(config, config.options.vllm_config)
    dtype = memory.torch_dtype(dtype_name)
    weights = memory.weight_bytes(hf_config, dtype)
    if weights is None:
        return
    ctx = config.settings.ctx_len
    kv = memory.kv_bytes_per_token(hf_config, dtype) * (-(-ctx // block_size) * block_size)
    device = open_device(config.device, device_request(config, hf_config, dtype))
    try:
        device.reserve("weights and the KV cache of one sequence", weights + kv)
    except DeviceMemoryError as exc:
        hints = []
        if dtype_name == "float32":
            hints.append("--dtype float16 (half the bytes)")
        if kv > weights / 8:
            hints.append(f"a shorter --max-model-len (one sequence of {ctx} tokens needs {memory.mb(kv)})")
        hints += ["a smaller model", "a card with more DDR per SoC (QAIC_SIM_TOPOLOGY on the simulator)"]
        raise QaicConfigError(
            f"{config.model_dir.name} does not fit {exc.device} in {MODE}: weights {memory.mb(weights)} and "
            f"one {ctx}-token sequence's KV cache {memory.mb(kv)} need {memory.mb(weights + kv)} but "
            f"{memory.mb(exc.free_bytes)} of {memory.mb(exc.total_bytes)} are free; use {', '.join(hints)}"
        ) from exc
    finally:
        device.close()


def _model_facts(config: ExecutionConfig, vllm_config: Any) -> tuple[Any, str, int]:
    """The HF config, dtype name and KV block size, from vLLM's config when there is one."""
    if vllm_config is not None and vllm_config.model_config is not None:
        block = int(vllm_config.cache_config.block_size or DEFAULT_BLOCK_SIZE)
        return vllm_config.model_config.hf_config, memory.dtype_name(vllm_config.model_config.dtype), block
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(config.model_dir), config.dtype, DEFAULT_BLOCK_SIZE
