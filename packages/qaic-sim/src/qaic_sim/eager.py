"""The simulator's eager device layer: CPU tensors accounted against a simulated SoC.

The eager path keeps its tensors on the host. This layer reserves their bytes from the SoC's DDR
(the same accounting programs use, so an eager model and compiled programs compete for it), and
wraps each step: the step counts as a run of the QID (fault injection, ``getPerformanceInfo``),
its device time comes from :func:`qaic_sim.timing_eager.eager_step_cost` on the machine's
:class:`~qaic_sim.timing.HardwareModel`, it is traced like a program run and, with pacing on,
lasts at least that long. A reset of the QID loses what the layer held there: its steps then fail
with DEV_ERROR, as a reset program's runs do, until the layer reserves that memory again (the
model placed its weights and KV cache again, as it must on a card).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from qaic_core.eager import DeviceMemoryError, EagerDeviceRequest, EagerStep
from qaic_core.env import QAIC_VISIBLE_DEVICES
from qaic_core.errors import QaicConfigError, QaicRuntimeError
from qaic_core.types import QStatus
from qaic_sim import timing, trace
from qaic_sim.clock import sleep_until
from qaic_sim.config import QAIC_SIM_TIMING, pace_as_config, pace_as_for
from qaic_sim.machine import SimMachine, get_machine
from qaic_sim.timing_eager import eager_step_cost
from qaic_sim.topology import SimDevice

log = logging.getLogger("qaic.sim.eager")

_PRECISIONS = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


def _free(device: SimDevice, generation: int, nbytes: int) -> None:
    with device.lock:
        if device.generation == generation:
            device.dram_used -= nbytes


class SimEagerDevice:
    """One simulated SoC as the eager path's device (see the module docstring)."""

    def __init__(self, request: EagerDeviceRequest, machine: SimMachine | None = None) -> None:
        self.machine = get_machine() if machine is None else machine
        ids = request.device_group or (0,)
        if len(ids) != 1:
            raise QaicConfigError(
                f"the eager path runs on one SoC, not on device_group {list(ids)}: give one device id"
            )
        topology = self.machine.topology
        device = topology.device(ids[0])
        if device is None:
            raise QaicConfigError(
                f"device {ids[0]} is not visible: the visible devices are {topology.ids()} "
                f"({QAIC_VISIBLE_DEVICES} filters and renumbers them)"
            )
        self.device = device
        self.label = request.label
        self.weight_precision = _precision(request.weight_dtype)
        self.kv_precision = _precision(request.kv_dtype)
        pace_as = pace_as_for(self.machine.config.pace_as)
        self.timing_config: Mapping[str, Any] = pace_as_config(pace_as) if pace_as else request.model_config
        self.hardware = timing.HardwareModel.for_device_group(device.sku, 1, None)
        self._held: dict[str, int] = {}
        self._lost: set[str] = set()
        """What a reset of the QID took from this layer and was not reserved again yet."""
        self._generation = device.generation
        self._lock = threading.Lock()
        self._finalizers: dict[str, weakref.finalize] = {}
        self._timing_warned = False

    # -- identity --------------------------------------------------------------------------
    @property
    def torch_device(self) -> str:
        return "cpu"

    @property
    def device_ids(self) -> tuple[int, ...]:
        return (self.device.qid,)

    @property
    def name(self) -> str:
        return f"QID {self.device.qid} (simulated {self.device.sku.value})"

    # -- memory ----------------------------------------------------------------------------
    def total_bytes(self) -> int:
        return self.device.dram_total

    def free_bytes(self) -> int:
        self._forget_if_reset()
        return self.device.dram_free

    def reserve(self, what: str, nbytes: int) -> None:
        if nbytes < 0:
            raise ValueError(f"cannot reserve {nbytes} bytes")
        dev = self.device
        with self._lock:
            self._forget_if_reset()
            with dev.lock:
                if nbytes > dev.dram_free:
                    raise DeviceMemoryError(
                        what, nbytes, dev.dram_free, dev.dram_total, self.name, details=self._held_details()
                    )
                dev.dram_used += nbytes
            self._held[what] = self._held.get(what, 0) + nbytes
            self._lost.discard(what)
            self._rearm(what)

    def settle(self, what: str, nbytes: int) -> None:
        with self._lock:
            self._forget_if_reset()
            delta = nbytes - self._held.get(what, 0)
            dev = self.device
            with dev.lock:
                if delta > dev.dram_free:
                    raise DeviceMemoryError(
                        what, nbytes, dev.dram_free + self._held.get(what, 0), dev.dram_total, self.name
                    )
                dev.dram_used += delta
            self._held[what] = nbytes
            self._lost.discard(what)
            self._rearm(what)

    def release(self, what: str) -> None:
        with self._lock:
            self._forget_if_reset()
            nbytes = self._held.pop(what, 0)
            self._lost.discard(what)
            finalizer = self._finalizers.pop(what, None)
            if finalizer is not None:
                finalizer.detach()
            if nbytes:
                _free(self.device, self._generation, nbytes)

    def held(self) -> dict[str, int]:
        """Bytes held per purpose (``weights``, ``kv cache``)."""
        with self._lock:
            return dict(self._held)

    def _held_details(self) -> dict[str, int]:
        return {f"{what} already held": n for what, n in self._held.items() if n}

    def _rearm(self, what: str) -> None:
        """A dropped layer gives its memory back (as a dropped program does)."""
        previous = self._finalizers.pop(what, None)
        if previous is not None:
            previous.detach()
        self._finalizers[what] = weakref.finalize(
            self, _free, self.device, self._generation, self._held[what]
        )

    def _forget_if_reset(self) -> None:
        """A device reset dropped everything the QID held, ours included: steps fail until it is placed again."""
        if self.device.generation != self._generation:
            for finalizer in self._finalizers.values():
                finalizer.detach()
            self._finalizers.clear()
            self._lost.update(what for what, nbytes in self._held.items() if nbytes)
            self._held.clear()
            self._generation = self.device.generation

    def _check_not_reset(self) -> None:
        """Raise DEV_ERROR while memory a reset took is not reserved again (a reset program fails likewise)."""
        with self._lock:
            self._forget_if_reset()
            lost = sorted(self._lost)
        if lost:
            raise QaicRuntimeError(
                f"QID {self.device.qid} was reset and the {' and '.join(lost)} held there are gone: place them "
                "again (the step model's recover()) before the next step",
                int(QStatus.DEV_ERROR),
            )

    # -- steps -----------------------------------------------------------------------------
    def device_time_s(self, work: EagerStep) -> float:
        """Modelled seconds of one step; 0 (with one warning) when the timing model is off."""
        if not self.machine.config.timing:
            if not self._timing_warned:
                self._timing_warned = True
                log.warning("%s=0: eager steps report 0 s device time", QAIC_SIM_TIMING)
            return 0.0
        try:
            cost = eager_step_cost(
                self.timing_config,
                list(work.query_lens),
                list(work.seq_lens),
                work.num_logits,
                weight_precision=self.weight_precision,
                kv_precision=self.kv_precision,
            )
        except ValueError as exc:
            raise QaicConfigError(
                f"the timing model cannot size {self.label}'s eager steps: {exc}; set {QAIC_SIM_TIMING}=0 "
                "to run without modelled device time"
            ) from exc
        return float(timing.device_time_s(cost, self.hardware))

    @contextmanager
    def step(self, work: EagerStep) -> Iterator[None]:
        dev = self.device
        self._check_not_reset()
        device_time = self.device_time_s(work)
        with dev.lock:
            dev.runs += 1
            count = dev.runs
        forced = self.machine.faults.on_run(dev.qid, count)
        if forced is not None:
            raise QaicRuntimeError(f"injected fault on QID {dev.qid}: {forced.name}", int(forced))
        start = time.perf_counter()
        status = 0
        try:
            yield
        except BaseException:
            status = 500
            raise
        finally:
            wall = time.perf_counter() - start
            config = self.machine.config
            if status == 0 and (config.pace or config.pace_as) and device_time > wall:
                sleep_until(start + device_time)
            with dev.lock:
                dev.device_time_s += device_time
                dev.wall_time_s += wall
            self._record(work, start, wall, device_time, status)

    def _record(self, work: EagerStep, start: float, wall: float, device_time: float, status: int) -> None:
        recorder = self.machine.trace.recorder()
        if recorder is None:
            return
        recorder.record(
            trace.RunRecord(
                program=self.label,
                specialization="eager",
                spec_index=0,
                qids=[self.device.qid],
                status=status,
                start_s=start,
                wall_s=wall,
                device_time_s=device_time,
                queue=0,
                exec_obj=0,
                extra={
                    "tokens": work.num_tokens,
                    "sequences": len(work.seq_lens),
                    "logits": work.num_logits,
                    "context_tokens": int(sum(work.seq_lens)),
                },
            )
        )

    def close(self) -> None:
        for what in list(self._held):
            self.release(what)


def _precision(dtype: str) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _PRECISIONS:
        raise QaicConfigError(
            f"the simulator cannot account {dtype!r} tensors: use float32, float16 or bfloat16"
        )
    return _PRECISIONS[name]


def open_eager_device(request: EagerDeviceRequest) -> SimEagerDevice:
    """The ``eager`` member of the simulator's DeviceBackend."""
    return SimEagerDevice(request)
