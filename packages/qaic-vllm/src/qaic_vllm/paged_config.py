"""vLLM's configuration for an execution path with a paged KV cache (``pyt``, the eager mode).

Unlike the slot layout of compiled programs, vLLM's own scheduler runs unchanged: it mixes
prefill chunks and decodes in one step under ``--max-num-batched-tokens``, caches prefixes (on by
default, ``--no-enable-prefix-caching`` turns it off) and preempts and recomputes when KV blocks
run out. The KV block size is vLLM's default (16) unless ``--block-size`` is given.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from qaic_core import get_plugin_manager
from qaic_core.errors import QaicConfigError
from qaic_core.execution import OpenOptions
from qaic_vllm import envs
from qaic_vllm.config import EXECUTION_MODE_KEY, OVERRIDE_KEY, engine_settings
from qaic_vllm.overrides import PARTIAL_PREFILLS

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from qaic_core.descriptors import ExecutionPath

log = logging.getLogger("qaic.vllm")

PAGED_WORKER_CLS = "qaic_vllm.worker.QaicPagedWorker"
PAGED_SCHEDULER_CLS = "qaic_vllm.scheduler.QaicPagedScheduler"
DEFAULT_BLOCK_SIZE = 16
SWITCH_TO_AOT = (
    f'(choose it with --additional-config \'{{"{EXECUTION_MODE_KEY}": "aot"}}\' or '
    f"{envs.VLLM_QAIC_EXECUTION_MODE}=aot)"
)


EAGER_KEYS = frozenset({"device_group", "num_devices"})
"""``override_qaic_config`` keys that mean something without a compiled program (where to run)."""


def _override_values(vllm_config: VllmConfig) -> dict[str, Any]:
    """The ``override_qaic_config`` keys given with a value, as given."""
    additional = vllm_config.additional_config
    overrides = additional.get(OVERRIDE_KEY) if isinstance(additional, dict) else None
    return {k: v for k, v in overrides.items() if v is not None} if isinstance(overrides, dict) else {}


def compiler_settings_given(vllm_config: VllmConfig) -> list[str]:
    """The ``override_qaic_config`` keys and ``VLLM_QAIC_*`` variables given that only compiling uses."""
    given = [f"override_qaic_config {key}" for key in _override_values(vllm_config) if key not in EAGER_KEYS]
    for var in (*envs.ENV_SETTINGS, envs.VLLM_QAIC_QPC_PATH):
        if os.environ.get(var, "").strip():
            given.append(var)
    return given


def configure_paged(vllm_config: VllmConfig, path: ExecutionPath) -> None:
    """Validate the engine arguments for ``path`` and set vLLM up to drive a paged-KV step model."""
    from qaic_vllm.validation import validate_model

    model_config = vllm_config.model_config
    assert model_config is not None
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1:
        raise QaicConfigError(
            f"--tensor-parallel-size {parallel.tensor_parallel_size} / --pipeline-parallel-size "
            f"{parallel.pipeline_parallel_size}: tensor parallelism across SoCs is not supported in the "
            f"{path.name} (eager) execution mode: run on one SoC, or use the aot mode {SWITCH_TO_AOT}"
        )
    if vllm_config.kv_transfer_config is not None:
        raise QaicConfigError(
            f"--kv-transfer-config (disaggregated serving) is not supported in the {path.name} (eager) "
            f"execution mode: drop it, or use the aot mode {SWITCH_TO_AOT}"
        )
    validate_model(vllm_config, path)
    if PARTIAL_PREFILLS in _override_values(vllm_config):
        raise QaicConfigError(
            f"override_qaic_config {PARTIAL_PREFILLS} sets how the aot mode's scheduler admits prompts; the "
            f"{path.name} (eager) execution mode schedules with vLLM's own scheduler: drop it, or use the aot "
            f"mode {SWITCH_TO_AOT}"
        )
    given = compiler_settings_given(vllm_config)
    if given:
        raise QaicConfigError(
            f"{', '.join(given)} set compiled programs up, but the {path.name} (eager) execution mode runs "
            f"vLLM's model classes without compiling: drop them, or use the aot mode {SWITCH_TO_AOT}"
        )
    settings = engine_settings(vllm_config)
    if path.check is not None:
        pm = get_plugin_manager()
        try:
            path.check(
                settings.execution_config(
                    model_config.model, pm.select_device_backend(), OpenOptions(vllm_config=vllm_config)
                )
            )
        except QaicConfigError as exc:
            if "aot execution mode" in str(exc):
                raise QaicConfigError(f"{exc} {SWITCH_TO_AOT}") from exc
            raise

    if parallel.worker_cls in ("auto", "", None):
        parallel.worker_cls = PAGED_WORKER_CLS
    sched = vllm_config.scheduler_config
    sched.scheduler_cls = PAGED_SCHEDULER_CLS  # vLLM's scheduling, and the device-fault policy
    if sched.async_scheduling:  # vLLM's default, or --async-scheduling
        log.info("qaic: async scheduling is off: not supported in the pyt (eager) execution mode")
    sched.async_scheduling = False

    run_eagerly(vllm_config)

    cache = vllm_config.cache_config
    if not cache.user_specified_block_size:
        cache.block_size = DEFAULT_BLOCK_SIZE
    log.info(
        "qaic: %s execution mode: KV blocks of %d tokens, prefix caching %s, up to %d sequences and %d "
        "tokens per step (%s)",
        path.name,
        cache.block_size,
        "on" if cache.enable_prefix_caching else "off",
        sched.max_num_seqs,
        sched.max_num_batched_tokens,
        settings.dtype,
    )


def run_eagerly(vllm_config: VllmConfig) -> None:
    """No torch.compile and no graph capture: a Cloud AI device runs programs or eager steps, not CUDA graphs."""
    from vllm.config import CompilationMode
    from vllm.config.compilation import CUDAGraphMode

    comp = vllm_config.compilation_config
    comp.mode = CompilationMode.NONE
    comp.cudagraph_capture_sizes = []
    comp.cudagraph_mode = CUDAGraphMode.NONE
    vllm_config.model_config.enforce_eager = True
