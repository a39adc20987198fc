"""vLLM's data parallelism on Cloud AI: each local engine core (replica) gets its own device group.

``--data-parallel-size N`` starts N engine cores, each with one worker of world size 1. A replica
needs ``num_devices`` SoCs (its tensor slicing is the compiler's), so local rank ``r`` runs on the
visible devices ``r * num_devices .. (r + 1) * num_devices - 1``: vllm-qaic's rule (local DP rank x
TP/PP world size = the device index). A ``device_group`` given with data parallelism lists every
local rank's devices in order, ``num_devices`` (or an equal share) each.

The groups are planned once, in the API process (which still sees ``--data-parallel-size-local``),
checked against the visible devices, and recorded in ``additional_config``; each engine core picks
its own by the local rank vLLM gives it (``parallel_config.data_parallel_rank_local``). vLLM runs
each dense-model replica as an independent engine (its ``data_parallel_size`` becomes 1 there and
``data_parallel_rank`` 0); ``parallel_config.data_parallel_index`` keeps the global rank.
vLLM's ``assigned_physical_gpu_ids`` counts one device per rank (world size 1), so it is not used.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from typing import TYPE_CHECKING, Any

from qaic_core import get_plugin_manager
from qaic_core.env import QAIC_VISIBLE_DEVICES
from qaic_core.errors import QaicConfigError

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger("qaic.vllm")

GROUPS_KEY = "qaic_data_parallel_device_groups"
"""``additional_config`` entry with each local rank's device group, written at configuration time."""
DEVICE_GROUP_FLAG = "--additional-config override_qaic_config device_group"


def local_replicas(vllm_config: VllmConfig) -> int:
    """Engine cores this node starts (``--data-parallel-size-local``); 1 without data parallelism."""
    parallel = vllm_config.parallel_config
    if int(parallel.data_parallel_size) <= 1:
        return 1
    return int(parallel.data_parallel_size_local)


def local_rank(vllm_config: VllmConfig) -> int:
    """This engine core's local data-parallel rank (vLLM sets it in each engine core; 0 elsewhere)."""
    rank = vllm_config.parallel_config.data_parallel_rank_local
    return int(rank) if rank is not None else 0


def data_parallel_rank(parallel_config: Any) -> int:
    """The replica's data-parallel rank across all nodes (0 without data parallelism).

    vLLM resets ``data_parallel_rank`` to 0 inside each dense-model engine core and keeps the global
    rank in ``data_parallel_index``, a field it sets after construction (so it may be absent before).
    """
    index = getattr(parallel_config, "data_parallel_index", None)
    if index is None:
        index = getattr(parallel_config, "data_parallel_rank", 0)
    return int(index or 0)


def visible_devices() -> list[int]:
    """The device ids the selected backend's runtime lists (visible ids, after QAIC_VISIBLE_DEVICES)."""
    backend = get_plugin_manager().select_device_backend()
    status, ids = backend.runtime().Util().getDeviceIds()
    return sorted(int(i) for i in ids) if int(status) == 0 and ids else []


def plan_groups(
    replicas: int, device_group: tuple[int, ...] | None, num_devices: int | None, visible: list[int]
) -> list[tuple[int, ...]]:
    """Each local rank's device group; an impossible plan is refused naming the devices that exist."""
    exist = f"the visible devices are {visible} ({QAIC_VISIBLE_DEVICES} filters and renumbers them)"
    if device_group is None:
        size = num_devices or 1
        groups = [tuple(range(r * size, (r + 1) * size)) for r in range(replicas)]
        needed = replicas * size
        if needed > len(visible):
            raise QaicConfigError(
                f"--data-parallel-size-local {replicas} x {size} device(s) per replica (num_devices) needs "
                f"{needed} devices but {exist}: lower --data-parallel-size(-local) or num_devices, or make "
                "more devices visible"
            )
    else:
        given = list(device_group)
        size = num_devices or len(given) // replicas
        if size < 1 or len(given) != replicas * size:
            raise QaicConfigError(
                f"{DEVICE_GROUP_FLAG} {given} does not give each of the {replicas} local data-parallel ranks "
                f"{'its ' + str(size) if size >= 1 else 'a'} device(s): list {replicas} x num_devices ids, "
                f"rank 0's first (e.g. {list(range(replicas * max(size, 1)))}), or drop device_group to use "
                f"consecutive groups; {exist}"
            )
        twice = sorted(d for d, n in Counter(given).items() if n > 1)
        if twice:
            raise QaicConfigError(
                f"{DEVICE_GROUP_FLAG} {given} gives device(s) {twice} to more than one data-parallel rank: "
                f"each rank needs its own devices; {exist}"
            )
        groups = [tuple(given[r * size : (r + 1) * size]) for r in range(replicas)]
        unknown = sorted(set(given) - set(visible))
        if unknown:
            raise QaicConfigError(
                f"{DEVICE_GROUP_FLAG} {given} names device(s) {unknown} that do not exist: {exist}"
            )
    return groups


def assign_device_groups(vllm_config: VllmConfig) -> None:
    """Plan and record each local rank's device group (configuration time; no-op without DP)."""
    replicas = local_replicas(vllm_config)
    additional = vllm_config.additional_config
    size = int(vllm_config.parallel_config.data_parallel_size)
    if replicas <= 1 and size <= 1:
        return
    if getattr(vllm_config.model_config, "is_moe", False):
        raise QaicConfigError(
            f"--data-parallel-size {size} with a mixture-of-experts model is not supported on Cloud AI yet: "
            "vLLM runs MoE replicas in lockstep over a cross-replica process group (for expert parallelism) "
            "that the Cloud AI worker does not join. Serve each replica with its own vllm serve on its own "
            f"{QAIC_VISIBLE_DEVICES} and balance in front of them, or drop --data-parallel-size"
        )
    if not isinstance(additional, dict) or GROUPS_KEY in additional:
        return
    from qaic_vllm.overrides import read_overrides

    values = read_overrides(vllm_config)  # only with DP: a pooling engine has not set its keys aside yet
    num_devices = values.get("num_devices")
    groups = plan_groups(
        max(replicas, 1),
        values.get("device_group"),
        int(num_devices) if num_devices else None,
        visible_devices(),
    )
    additional[GROUPS_KEY] = [list(g) for g in groups]
    log.info(
        "qaic: data parallelism: %d replica(s) of %d on this node, device groups %s",
        replicas,
        size,
        [list(g) for g in groups],
    )


def replica_values(vllm_config: VllmConfig, values: dict[str, Any]) -> dict[str, Any]:
    """The override values with this replica's ``device_group`` (unchanged without data parallelism)."""
    additional = vllm_config.additional_config
    groups = additional.get(GROUPS_KEY) if isinstance(additional, dict) else None
    if not groups:
        return values
    rank = local_rank(vllm_config)
    if not 0 <= rank < len(groups):
        raise QaicConfigError(
            f"data-parallel local rank {rank} has no device group (groups: {groups}): "
            "--data-parallel-size-local and the device groups disagree"
        )
    group = tuple(int(d) for d in groups[rank])
    return {**values, "device_group": group, "num_devices": len(group)}


def replica_note(vllm_config: VllmConfig, device_group: tuple[int, ...] | None) -> str | None:
    """The log line saying which rank runs on which devices; None without data parallelism."""
    additional = vllm_config.additional_config
    if not isinstance(additional, dict) or GROUPS_KEY not in additional:
        return None
    visible = os.environ.get(QAIC_VISIBLE_DEVICES)
    return (
        f"qaic: data-parallel rank {data_parallel_rank(vllm_config.parallel_config)} (local rank {local_rank(vllm_config)}) "
        f"runs on device group {list(device_group or ())}"
        + (f" of {QAIC_VISIBLE_DEVICES}={visible}" if visible else "")
    )
