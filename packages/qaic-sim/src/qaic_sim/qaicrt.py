"""The simulator's ``qaicrt``: the real runtime's Python names over simulated devices.

A session written for the real module (QEfficient's ``QAICInferenceSession``, vllm-qaic's
session) runs unchanged with ``qaicrt = qaic_sim.qaicrt`` and ``aicapi = qaic_sim.aicapi``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import SupportsInt

from qaic_core.errors import QaicRuntimeError
from qaic_sim.buffers import BufferDimensionsVecRef, QBuffer
from qaic_sim.execobj import ExecObj
from qaic_sim.machine import SimMachine, get_machine
from qaic_sim.program import Program, QAicProgramProperties, Qpc, SlicingSpecHandle
from qaic_sim.status import QLogLevel, QStatus
from qaic_sim.topology import MB, SimDevice

log = logging.getLogger("qaic.sim.runtime")

__all__ = [
    "BufferDimensionsVecRef",
    "Context",
    "ExecObj",
    "Program",
    "QAicProgramProperties",
    "QAicQueueProperties",
    "QBuffer",
    "QIDList",
    "QLogLevel",
    "QStatus",
    "Qpc",
    "Queue",
    "SlicingSpecHandle",
    "Util",
]


class QIDList(list):  # type: ignore[type-arg]
    """A list of device ids (QIDs)."""


class Context:
    """A set of devices this process works with; ``Context()`` takes every visible device.

    The context binds to the current :class:`qaic_sim.machine.SimMachine`; programs, queues and exec
    objects made from it use that machine.
    """

    def __init__(self, devices: Iterable[int] | None = None, *args: object) -> None:
        self.machine: SimMachine = get_machine()
        topo = self.machine.topology
        ids = list(devices) if devices is not None else topo.ids()
        missing = [q for q in ids if topo.device(q) is None]
        if missing:
            raise QaicRuntimeError(
                f"device(s) {missing} do not exist; visible devices: {topo.ids()} (see QAIC_VISIBLE_DEVICES and "
                "QAIC_SIM_TOPOLOGY)",
                status=int(QStatus.NODEV),
            )
        self.devices = ids
        self.logLevel = QLogLevel.QL_WARN

    def setLogLevel(self, level: SupportsInt) -> QStatus:
        self.logLevel = QLogLevel(int(level))
        if self.logLevel == QLogLevel.QL_DEBUG:
            logging.getLogger("qaic.sim").setLevel(logging.DEBUG)
        return QStatus.SUCCESS


class QAicQueueProperties:
    """Queue properties: ``numThreadsPerQueue`` runs that many exec objects at once."""

    __slots__ = ("numThreadsPerQueue",)

    def __init__(self) -> None:
        self.numThreadsPerQueue = 1


class Queue:
    """Runs enqueued exec objects on worker threads, in order per thread.

    When pacing is off and nothing else is queued on the program's devices, an exec object's run is
    held and executes in the caller's thread when it is first needed: at ``waitForCompletion`` (or
    ``getData`` or a new ``setData`` on it), at the next enqueue on the same devices, or when the
    program is deactivated. ``enqueue`` returns at once, as a card's does, and the host work a
    caller does between enqueue and wait comes before the run instead of after it (no hand-off to a
    worker and back). As on a card, the bound host buffers are read by the run, so they must stay
    unchanged until the wait. Paced runs, and runs enqueued while another is queued or running on a
    worker for the same devices, keep the worker threads, so exec objects still overlap as on a
    card. A paced run's worker does not sleep out its modelled time: the run ends, for its waiter
    and for the next run on its program or queue, at that modelled end.
    """

    _ids = 0

    def __init__(self, ctx: Context, device: int = 0, props: QAicQueueProperties | None = None) -> None:
        topo = ctx.machine.topology
        if topo.device(device) is None:
            raise QaicRuntimeError(
                f"queue device {device} does not exist; visible devices: {topo.ids()} "
                "(see QAIC_VISIBLE_DEVICES and QAIC_SIM_TOPOLOGY)",
                status=int(QStatus.NODEV),
            )
        self.ctx = ctx
        self.device = device
        self.props = props or QAicQueueProperties()
        Queue._ids += 1
        self.id = Queue._ids
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._free_at = 0.0  # when the last run this queue started ends (paced: its modelled end)

    def initProperties(self, props: QAicQueueProperties) -> QStatus:
        if int(props.numThreadsPerQueue) < 1:
            log.error("numThreadsPerQueue must be >= 1, got %s", props.numThreadsPerQueue)
            return QStatus.INVAL
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
            self.props = props
        return QStatus.SUCCESS

    def enqueue(self, exe: ExecObj) -> QStatus:
        machine = exe.program.machine
        devices = exe.program.devices
        machine.run_held(devices)  # a run enqueued before on these devices executes first
        if not (machine.config.pace or machine.config.pace_as) and exe.hold(
            self.id, lambda: machine.claim_held(devices, exe), lambda: machine.release_held(devices, exe)
        ):
            return QStatus.SUCCESS
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=int(self.props.numThreadsPerQueue), thread_name_prefix=f"qaic-sim-q{self.id}"
                )
            devices = list(exe.program.devices)
            machine.queued(devices, 1)
            enqueued = time.perf_counter()

            def run() -> QStatus:
                try:
                    # One worker runs its exec objects in order: each starts once the one before ends.
                    serial = int(self.props.numThreadsPerQueue) == 1
                    status = exe.execute(self.id, enqueued, self._free_at if serial else 0.0, wait=False)
                    self._free_at = max(self._free_at, exe.ready_at)
                    return status
                finally:  # before the result is set, so a caller woken by it may hold its next run at once
                    machine.queued(devices, -1)

            try:
                exe.submit(self._pool.submit(run))
            except BaseException:
                machine.queued(devices, -1)
                raise
        return QStatus.SUCCESS

    def __del__(self) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=False)


@dataclass
class QResourceInfo:
    """``Util.getResourceInfo``: counts, and DDR in MB."""

    nspTotal: int
    nspFree: int
    dramTotal: int
    dramFree: int
    vcTotal: int = 16
    vcFree: int = 16
    mcidTotal: int = 4096
    mcidFree: int = 4096
    semTotal: int = 32
    semFree: int = 32
    pcTotal: int = 32
    pcFree: int = 32
    skuType: str = ""


@dataclass
class QDevInfo:
    """``Util.getDeviceInfo``: identity of one QID."""

    qid: int
    physicalQid: int
    name: str
    skuType: str
    cardId: int
    socId: int
    pciVendorId: int
    pciDeviceId: int
    nspTotal: int
    dramTotal: int
    devStatus: str = "READY"


@dataclass
class QPerformanceInfo:
    """``Util.getPerformanceInfo``: runs and modelled device time on one QID (simulator fields)."""

    numRuns: int
    deviceTimeS: float
    wallTimeS: float
    avgDeviceTimeUs: float
    nspUsed: int
    nspTotal: int


class Util:
    """Device queries: ids, identity, free resources, performance counters, locking."""

    @staticmethod
    def _device(qid: int) -> SimDevice | None:
        return get_machine().topology.device(qid)

    def getDeviceIds(self) -> tuple[QStatus, list[int]]:
        return QStatus.SUCCESS, get_machine().topology.ids()

    def getDeviceInfo(self, qid: int) -> tuple[QStatus, QDevInfo | None]:
        dev = self._device(qid)
        if dev is None:
            return QStatus.NODEV, None
        info = dev.info()
        return QStatus.SUCCESS, QDevInfo(
            qid=dev.qid,
            physicalQid=dev.physical_qid,
            name=f"Cloud AI 100 {dev.sku.value} (simulated)",
            skuType=dev.sku.value,
            cardId=dev.card,
            socId=dev.soc,
            pciVendorId=info.pci_vendor,
            pciDeviceId=info.pci_device,
            nspTotal=dev.nsp_total,
            dramTotal=dev.dram_total // MB,
        )

    def getResourceInfo(self, qid: int) -> tuple[QStatus, QResourceInfo | None]:
        dev = self._device(qid)
        if dev is None:
            return QStatus.NODEV, None
        return QStatus.SUCCESS, QResourceInfo(
            nspTotal=dev.nsp_total,
            nspFree=dev.nsp_free,
            dramTotal=dev.dram_total // MB,
            dramFree=dev.dram_free // MB,
            skuType=dev.sku.value,
        )

    def getPerformanceInfo(self, qid: int) -> tuple[QStatus, QPerformanceInfo | None]:
        dev = self._device(qid)
        if dev is None:
            return QStatus.NODEV, None
        avg = dev.device_time_s / dev.runs * 1e6 if dev.runs else 0.0
        return QStatus.SUCCESS, QPerformanceInfo(
            numRuns=dev.runs,
            deviceTimeS=dev.device_time_s,
            wallTimeS=dev.wall_time_s,
            avgDeviceTimeUs=avg,
            nspUsed=dev.nsp_used,
            nspTotal=dev.nsp_total,
        )

    def lockDevice(self, qid: int, lock: bool = True, block: bool = True) -> QStatus:
        """Mark a device locked by this process (advisory, as in one process the sim is exclusive)."""
        dev = self._device(qid)
        if dev is None:
            return QStatus.NODEV
        if lock and dev.locked and not block:
            return QStatus.BUSY
        dev.locked = bool(lock)
        return QStatus.SUCCESS
