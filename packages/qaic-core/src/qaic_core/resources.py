"""Free and total resources of the devices a program will use, read through any backend's runtime."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from qaic_core.descriptors import DeviceBackend
from qaic_core.types import QStatus

log = logging.getLogger("qaic.resources")

MB = 1024 * 1024


@dataclass(frozen=True)
class DeviceResources:
    """One QID as ``Util.getResourceInfo`` reports it (DDR in MB, as the runtime gives it)."""

    qid: int
    nsp_total: int
    nsp_free: int
    dram_total_mb: int
    dram_free_mb: int
    sku: str = ""

    @property
    def dram_free_bytes(self) -> int:
        return self.dram_free_mb * MB

    @property
    def dram_total_bytes(self) -> int:
        return self.dram_total_mb * MB


def query_devices(backend: DeviceBackend, ids: Sequence[int]) -> list[DeviceResources]:
    """Resources of each QID in ``ids`` (visible ids); a QID the runtime does not know is left out."""
    util = backend.runtime().Util()
    found: list[DeviceResources] = []
    for qid in ids:
        status, info = util.getResourceInfo(int(qid))
        if int(status) != QStatus.SUCCESS or info is None:
            log.debug("getResourceInfo(%d) failed with status %s", qid, int(status))
            continue
        found.append(
            DeviceResources(
                qid=int(qid),
                nsp_total=int(info.nspTotal),
                nsp_free=int(info.nspFree),
                dram_total_mb=int(info.dramTotal),
                dram_free_mb=int(info.dramFree),
                sku=str(getattr(info, "skuType", "") or ""),
            )
        )
    return found


def group_ids(device_group: Sequence[int] | None, num_devices: int) -> list[int]:
    """The QIDs a program runs on: ``device_group``, else the first ``num_devices`` visible ones."""
    return list(device_group) if device_group else list(range(num_devices))
