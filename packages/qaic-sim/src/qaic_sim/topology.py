"""Simulated cards and their SoCs (QIDs): NSP cores and DDR accounted per QID.

One topology belongs to the process's :class:`qaic_sim.machine.SimMachine`: every program loaded
through :mod:`qaic_sim.qaicrt` draws on its devices. ``QAIC_VISIBLE_DEVICES`` filters and renumbers them.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from qaic_core.env import parse_visible_devices
from qaic_core.types import SKUS, DeviceInfo, SkuSpec, SkuType
from qaic_sim.config import SimConfig

log = logging.getLogger("qaic.sim.topology")

MB = 1024 * 1024


@dataclass
class SimDevice:
    """One SoC: its identity, free resources, reset generation and counters."""

    qid: int
    physical_qid: int
    sku: SkuType
    card: int
    soc: int
    spec: SkuSpec
    nsp_used: int = 0
    dram_used: int = 0
    generation: int = 0
    runs: int = 0
    loads: int = 0
    device_time_s: float = 0.0
    wall_time_s: float = 0.0
    locked: bool = False
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False)

    @property
    def nsp_total(self) -> int:
        return self.spec.nsp_per_soc

    @property
    def nsp_free(self) -> int:
        return self.nsp_total - self.nsp_used

    @property
    def dram_total(self) -> int:
        """DDR in bytes."""
        return self.spec.dram_mb_per_soc * MB

    @property
    def dram_free(self) -> int:
        return self.dram_total - self.dram_used

    def info(self) -> DeviceInfo:
        return DeviceInfo(
            qid=self.qid,
            sku=self.sku,
            card=self.card,
            nsp_total=self.nsp_total,
            nsp_free=self.nsp_free,
            dram_total_mb=self.dram_total // MB,
            dram_free_mb=self.dram_free // MB,
        )

    def reset(self) -> None:
        """A device reset: every program on this QID loses its resources and state."""
        with self.lock:
            self.generation += 1
            self.nsp_used = 0
            self.dram_used = 0
        log.warning(
            "QID %d (physical %d) was reset; programs on it must be loaded again", self.qid, self.physical_qid
        )


class Topology:
    """The cards of a :class:`SimConfig`; ``devices`` are the visible QIDs in visible order."""

    def __init__(self, config: SimConfig, visible: str | None = None) -> None:
        self.config = config
        physical: list[tuple[SkuType, int, int]] = []
        for card, sku in enumerate(config.cards):
            for soc in range(SKUS[sku].socs):
                physical.append((sku, card, soc))
        ids = parse_visible_devices(visible, list(range(len(physical))))
        self.devices: list[SimDevice] = []
        for qid, pqid in enumerate(ids):
            sku, card, soc = physical[pqid]
            self.devices.append(SimDevice(qid, pqid, sku, card, soc, SKUS[sku]))
        self.num_physical = len(physical)

    def device(self, qid: int) -> SimDevice | None:
        if isinstance(qid, bool) or not isinstance(qid, int) or not 0 <= qid < len(self.devices):
            return None
        return self.devices[qid]

    def ids(self) -> list[int]:
        return [d.qid for d in self.devices]
