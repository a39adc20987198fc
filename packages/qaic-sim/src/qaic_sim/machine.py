"""The simulated host: one object owning the cards, the fault plan, the trace recorder and the image cache.

The runtime (:mod:`qaic_sim.qaicrt`) reaches simulator state only through a :class:`SimMachine`: a
``Context`` binds to the process-wide machine (created from the environment on first use) and every
``Program``, ``Queue`` and ``ExecObj`` made from it uses that machine. :func:`reset_machine` replaces it
(tests, or after changing the environment); objects made earlier keep the machine they were made on.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections.abc import Sequence
from typing import Protocol

from qaic_core.env import QAIC_VISIBLE_DEVICES
from qaic_sim import timing
from qaic_sim.config import QAIC_SIM_TIMING, SimConfig, load_config, pace_as_config, pace_as_for
from qaic_sim.faults import FaultPlan
from qaic_sim.image import ImageCache, ProgramImage
from qaic_sim.topology import SimDevice, Topology
from qaic_sim.trace import Tracer

log = logging.getLogger("qaic.sim.machine")


class HeldRun(Protocol):
    """An exec object whose unpaced run was enqueued and has not executed yet (``Queue.enqueue``)."""

    def run_held(self) -> None:
        """Execute the held run now, in the calling thread (nothing if it already ran)."""


class SimMachine:
    """One simulated host: its topology, the faults armed on it, its tracing and its compiled images."""

    def __init__(self, config: SimConfig | None = None, visible: str | None = None) -> None:
        self.config = load_config() if config is None else config
        self.topology = Topology(self.config, visible)
        self.faults = FaultPlan(self.topology)
        self.faults.configure(self.config.faults, "QAIC_SIM_FAULTS (or the faults key of QAIC_SIM_CONFIG)")
        self.trace = Tracer(self.config.trace_dir)
        self.images = ImageCache()
        self._timing_off_warned = threading.Event()
        self._busy_lock = threading.Lock()
        self._busy: dict[int, int] = {}
        """Runs queued on worker threads, held or running inline, per QID (``Queue.enqueue`` reads it)."""
        self._held: dict[int, HeldRun] = {}
        """The held run of each QID that has one (at most one: the next enqueue runs it first)."""

    @classmethod
    def from_environment(cls) -> SimMachine:
        """A machine as the environment describes it (``QAIC_SIM_*`` and ``QAIC_VISIBLE_DEVICES``)."""
        machine = cls(load_config(), os.environ.get(QAIC_VISIBLE_DEVICES))
        log.info(
            "simulated devices: %d QIDs on %d cards (%s; config from %s)",
            len(machine.topology.devices),
            len(machine.config.cards),
            ",".join(s.value for s in machine.config.cards),
            machine.config.source,
        )
        return machine

    def device_time_s(self, image: ProgramImage, spec: int, devices: Sequence[SimDevice]) -> float:
        """Modelled device time of one run; 0 (with one warning) only when timing is switched off."""
        if not self.config.timing:
            if not self._timing_off_warned.is_set():
                self._timing_off_warned.set()
                log.warning(
                    "%s=0: the timing model is off; every run reports 0 s device time "
                    "(getPerformanceInfo, traces) and dataPathTimeoutMs is not checked against it",
                    QAIC_SIM_TIMING,
                )
            return 0.0
        return image.device_time_s(
            spec,
            devices[0].sku,
            len(devices),
            image.manifest.num_cores,
            pace_as_for(self.config.pace_as, str(image.path)),
        )

    def queued(self, devices: Sequence[SimDevice], delta: int) -> None:
        """Count a run handed to (``+1``) or finished on (``-1``) a queue's worker thread."""
        with self._busy_lock:
            for dev in devices:
                self._busy[dev.qid] = self._busy.get(dev.qid, 0) + delta

    def claim_held(self, devices: Sequence[SimDevice], held: HeldRun) -> bool:
        """Claim the devices for a run in the caller's thread: True when none of them has a run queued.

        The claimed run is ``held``: it executes when it is first needed (:meth:`run_held`), and
        :meth:`release_held` gives the devices back once it has.
        """
        with self._busy_lock:
            if any(self._busy.get(dev.qid, 0) for dev in devices):
                return False
            for dev in devices:
                self._busy[dev.qid] = 1
                self._held[dev.qid] = held
            return True

    def release_held(self, devices: Sequence[SimDevice], held: HeldRun) -> None:
        with self._busy_lock:
            for dev in devices:
                if self._held.get(dev.qid) is held:
                    del self._held[dev.qid]
                self._busy[dev.qid] = self._busy.get(dev.qid, 0) - 1

    def run_held(self, devices: Sequence[SimDevice] | None = None) -> None:
        """Execute, in this thread, the held runs of ``devices`` (of every device when None), so that
        what comes next (another enqueue, a deactivation) finds them done, as on a card."""
        with self._busy_lock:
            qids = None if devices is None else {dev.qid for dev in devices}
            pending = {id(h): h for q, h in self._held.items() if qids is None or q in qids}
        for held in pending.values():
            held.run_held()

    def slice_transfer_s(self, devices: Sequence[SimDevice], nbytes: int, positions: int) -> float:
        """Host-link time of a run's KV slices (``setDataWithSlices``): their bytes over the SoCs' PCIe.

        Each SoC of the group moves its share over its own link. With ``pace_as`` the slices are
        sized as that model's KV at the same number of positions (fp16 on the link), so a paced
        disaggregated run pays what the real model's hand-off would.
        """
        if not self.config.timing or nbytes <= 0:
            return 0.0
        pace_as = pace_as_for(self.config.pace_as)
        if pace_as:
            shape = timing.DecoderShape.from_config(pace_as_config(pace_as))
            nbytes = positions * shape.kv_elements_per_token * 2
        hw = timing.HardwareModel.for_device_group(devices[0].sku, len(devices), None)
        return nbytes / (hw.host_bytes_per_s * len(devices))

    def close(self) -> None:
        """Execute any held run, then write out any trace in progress."""
        self.run_held()
        self.trace.stop()


_lock = threading.Lock()
_machine: SimMachine | None = None


def get_machine() -> SimMachine:
    """The process-wide machine, built from the environment on first use."""
    global _machine
    with _lock:
        if _machine is None:
            _machine = SimMachine.from_environment()
        return _machine


def reset_machine(machine: SimMachine | None = None) -> SimMachine:
    """Replace the process-wide machine (by ``machine``, else a fresh one from the environment)."""
    global _machine
    with _lock:
        previous, _machine = _machine, machine
    if previous is not None:
        previous.close()
    return get_machine()


def _close_at_exit() -> None:
    with _lock:
        machine = _machine
    if machine is not None:
        machine.close()


atexit.register(_close_at_exit)
