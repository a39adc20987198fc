"""Defaults sized to the device: NSP cores from the device, and a batch and context that fit its memory.

vllm-qaic compiles for the device's cores (``nspTotal``). Without ``--max-num-seqs`` /
``--max-model-len`` vLLM would pick 256 (or 128) sequences and the model's full context, which a card
may not hold; here the missing ones are chosen to fit the device group's memory as the compiler counts
it (the execution path's ``size``), and the choice is logged with its reason. A shape given in full that
cannot fit fails before compiling, naming the largest that would.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from qaic_core import get_plugin_manager
from qaic_core.errors import QaicConfigError
from qaic_core.execution import ShapeRequest
from qaic_core.resources import DeviceResources, group_ids, query_devices
from qaic_core.settings import CompileSettings
from qaic_vllm.compat.engine_args import batch_defaulted

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger("qaic.vllm")


def batch_given(vllm_config: VllmConfig) -> bool:
    """``--max-num-seqs`` was given (vLLM did not fill it in; see qaic_vllm.compat.engine_args)."""
    return not batch_defaulted(vllm_config.model_config)


def ctx_given(vllm_config: VllmConfig) -> bool:
    """``--max-model-len`` was given (None: not given; -1: vLLM's "fit to memory", also chosen here)."""
    return vllm_config.model_config.original_max_model_len not in (None, -1)


def group_devices(device_group: tuple[int, ...] | None, num_devices: int) -> list[DeviceResources]:
    """The device group's resources; a device the runtime does not report is an error naming it."""
    backend = get_plugin_manager().select_device_backend()
    ids = group_ids(device_group, num_devices)
    found = query_devices(backend, ids)
    missing = sorted(set(ids) - {d.qid for d in found})
    if missing:
        raise QaicConfigError(
            f"device(s) {missing} of the device group {ids} are not available on the {backend.name} backend: "
            "check the ids with qaic-util (or qaic-sim list); they count visible devices (QAIC_VISIBLE_DEVICES)"
        )
    return found


def device_cores(devices: list[DeviceResources]) -> int:
    """NSP cores to compile for by default: the fewest any device of the group has (vllm-qaic's rule)."""
    return min(d.nsp_total for d in devices)


def fit_shape(
    vllm_config: VllmConfig, settings: CompileSettings, devices: list[DeviceResources], model_dir: Path
) -> CompileSettings:
    """Choose what the user left unset so the program fits; refuse a given shape that cannot.

    Done once: vLLM configures again inside the engine process, after the program took its memory.
    """
    if _sized(vllm_config) == (settings.decode_batch_size, settings.ctx_len):
        return settings
    from qaic_vllm.config import execution_path_of

    path = get_plugin_manager().select_execution_path(execution_path_of(vllm_config))
    if path.size is None:
        return settings
    sc = vllm_config.speculative_config
    k = int(sc.num_speculative_tokens or 0) if sc is not None else 0
    probe = settings.replace(num_speculative_tokens=k) if k and k + 1 <= settings.ctx_len else settings
    batch = settings.full_batch_size if batch_given(vllm_config) else None
    ctx = settings.ctx_len if ctx_given(vllm_config) else None
    request = ShapeRequest(model_dir, probe, devices, batch, ctx, int(vllm_config.model_config.max_model_len))
    choice = path.size(request)
    if batch is not None and ctx is not None:
        return settings
    unset = " and ".join(
        flag for flag, value in (("--max-num-seqs", batch), ("--max-model-len", ctx)) if value is None
    )
    chosen = choice.settings
    log.info(
        "qaic: %s not given: chose --max-num-seqs %d --max-model-len %d for %s: %s; the program takes %s "
        "(pass %s to choose yourself)",
        unset,
        chosen.decode_batch_size,
        chosen.ctx_len,
        model_dir.name,
        choice.reason,
        choice.memory,
        unset,
    )
    return settings.replace(
        full_batch_size=chosen.full_batch_size, ctx_len=chosen.ctx_len, prefill_seq_len=chosen.prefill_seq_len
    )


SIZED_KEY = "qaic_sized_shape"
"""``additional_config`` entry recording the checked shape, so the engine process does not size it again."""


def _sized(vllm_config: VllmConfig) -> tuple[int, int] | None:
    additional = vllm_config.additional_config
    shape = additional.get(SIZED_KEY) if isinstance(additional, dict) else None
    return (int(shape[0]), int(shape[1])) if isinstance(shape, list | tuple) and len(shape) == 2 else None


def apply_shape(vllm_config: VllmConfig, settings: CompileSettings) -> None:
    """Write a chosen batch and context back to vLLM's config (the worker reads them from there)."""
    vllm_config.model_config.max_model_len = settings.ctx_len
    vllm_config.scheduler_config.max_num_seqs = settings.decode_batch_size
    if isinstance(vllm_config.additional_config, dict):
        vllm_config.additional_config[SIZED_KEY] = [settings.decode_batch_size, settings.ctx_len]
