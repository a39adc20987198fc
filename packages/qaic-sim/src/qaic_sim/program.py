"""``Qpc`` and ``Program``: loading into device DDR, NSP activation, retained state, slicing specs."""

from __future__ import annotations

import json
import logging
import math
import re
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from qaic_core.types import Binding
from qaic_sim import mx
from qaic_sim.image import ProgramImage
from qaic_sim.machine import SimMachine, get_machine
from qaic_sim.status import Failure, QStatus
from qaic_sim.topology import SimDevice

if TYPE_CHECKING:
    from qaic_sim.qaicrt import Context

log = logging.getLogger("qaic.sim.runtime")


class Qpc:
    """A compiled program on disk (the folder holding ``programqpc.bin``), read through the machine's cache."""

    def __init__(self, path: str) -> None:
        self.path = str(path)
        self.image: ProgramImage = get_machine().images.open(path)

    def getIoDescriptor(self) -> tuple[QStatus, bytes]:
        return QStatus.SUCCESS, self.image.iodesc


class QAicProgramProperties:
    """Program properties; setting an unknown name raises AttributeError as the real binding does."""

    __slots__ = (
        "SubmitNumRetries",
        "SubmitRetryTimeoutMs",
        "dataPathTimeoutMs",
        "devMapping",
        "numMaxWaitRetries",
        "waitTimeoutMs",
    )

    def __init__(self) -> None:
        self.devMapping = ""
        self.dataPathTimeoutMs = 0
        self.SubmitRetryTimeoutMs = 0
        self.SubmitNumRetries = 0
        self.numMaxWaitRetries = 0
        self.waitTimeoutMs = 0


@dataclass(frozen=True)
class SliceSpec:
    """One BufferSpec of a slicing spec: a name pattern and a start per dimension."""

    pattern: re.Pattern[str]
    elem_size: int
    starts: tuple[int | str, ...]


class SlicingSpecHandle:
    """What ``createSlicingSpecHandle`` returns: parsed BufferSpecs of one program."""

    def __init__(self, specs: list[SliceSpec]) -> None:
        self.specs = specs

    def find(self, name: str) -> SliceSpec | None:
        return next((s for s in self.specs if s.pattern.fullmatch(name)), None)


def _free(devices: list[SimDevice], generations: list[int], nsp: int, dram: int) -> None:
    """Give back what a program holds on devices that were not reset since it took it."""
    for dev, gen in zip(devices, generations, strict=True):
        with dev.lock:
            if dev.generation == gen:
                dev.nsp_used -= nsp
                dev.dram_used -= dram


class Program:
    """A program instance on a device group: ``load`` takes DDR, ``activate`` takes NSP cores."""

    def __init__(
        self, ctx: Context, device: int | None, qpc: Qpc, props: QAicProgramProperties | None = None
    ) -> None:
        self.ctx = ctx
        self.machine: SimMachine = ctx.machine
        self.qpc = qpc
        self.image = qpc.image
        self.props = props or QAicProgramProperties()
        self.device = device
        self.devices: list[SimDevice] = []
        self.generations: list[int] = []
        self.loaded = False
        self.active = False
        self.lastError = ""
        self.state: dict[str, Any] = {}
        self.run_lock = threading.Lock()
        self.device_free_at = 0.0
        """``perf_counter`` time the program's last run ended (paced runs: its modelled end)."""
        self._held = {"nsp": 0, "dram": 0}
        self._finalizer: weakref.finalize | None = None

    # -- resources -----------------------------------------------------------------------
    def _group(self) -> list[SimDevice]:
        mapping = str(self.props.devMapping or "").strip()
        topo = self.machine.topology
        if mapping:
            if self.device is not None:
                raise Failure(
                    QStatus.INVAL,
                    "devMapping is set: pass None as the device of Program(ctx, None, qpc, props)",
                )
            try:
                ids = [int(x) for x in mapping.split(":")]
            except ValueError:
                raise Failure(
                    QStatus.INVAL, f"devMapping {mapping!r} must be device ids joined by ':' such as '0:1'"
                ) from None
        elif self.device is not None:
            ids = [int(self.device)]
        else:
            ids = list(self.ctx.devices)[: self.image.manifest.num_devices]
        if len(set(ids)) != len(ids):
            raise Failure(QStatus.INVAL, f"devMapping {mapping!r} lists a device twice")
        devices = []
        for qid in ids:
            dev = topo.device(qid)
            if dev is None or qid not in self.ctx.devices:
                raise Failure(
                    QStatus.NODEV, f"device {qid} is not in this context (devices {list(self.ctx.devices)})"
                )
            devices.append(dev)
        need = self.image.manifest.num_devices
        if len(devices) != need:
            raise Failure(
                QStatus.INVAL,
                f"{self.qpc.path} was compiled for {need} device(s) (-mdp-load-partition-config) but is loaded on "
                f"{len(devices)} ({ids}): set devMapping to {need} device ids or recompile",
            )
        return devices

    def _fail(self, exc: Failure) -> QStatus:
        self.lastError = exc.message
        log.error("%s: %s", self.qpc.path, exc.message)
        return exc.status

    def _stale(self) -> bool:
        return any(d.generation != g for d, g in zip(self.devices, self.generations, strict=True))

    def load(self) -> QStatus:
        """Reserve DDR for weights, retained state and activations on every device of the group."""
        if self.loaded and not self._stale():
            return QStatus.SUCCESS
        if self.loaded:
            self._release()
        try:
            devices = self._group()
            m = self.image.manifest
            per_device = math.ceil(m.dram_bytes / len(devices))
            for dev in devices:
                dev.loads += 1
                if self.machine.faults.on_load(dev.qid, dev.loads):
                    raise Failure(QStatus.NOMEM, f"injected fault: out of memory loading on QID {dev.qid}")
            for dev in devices:
                dev.lock.acquire()
            try:
                short = [d for d in devices if d.dram_free < per_device]
                if short:
                    d = short[0]
                    raise Failure(
                        QStatus.NOMEM,
                        f"not enough device memory on QID {d.qid}: the program needs {per_device / 2**20:.1f} MB "
                        f"(weights {m.weights_bytes / 2**20:.1f} MB, retained state {m.retained_bytes / 2**20:.1f} MB, "
                        f"activations {m.activation_bytes / 2**20:.1f} MB over {len(devices)} device(s)) but "
                        f"{d.dram_free / 2**20:.1f} of {d.dram_total / 2**20:.0f} MB are free; unload other programs, "
                        "use -mxfp6-matmul / mxint8 KV, a shorter ctx_len, or more devices",
                    )
                for d in devices:
                    d.dram_used += per_device
            finally:
                for dev in devices:
                    dev.lock.release()
        except Failure as exc:
            return self._fail(exc)
        try:
            self.image.session(self.machine.config.threads)
        except Exception as exc:  # the executor's errors become a load failure
            _free(devices, [d.generation for d in devices], 0, per_device)
            return self._fail(Failure(QStatus.ERROR, f"the program cannot be loaded: {exc}"))
        self.devices = devices
        self.generations = [d.generation for d in devices]
        self._held = {"nsp": 0, "dram": per_device}
        self.loaded = True
        self.state = {}
        self._finalizer = weakref.finalize(self, _free, devices, list(self.generations), 0, per_device)
        log.info(
            "loaded %s on QIDs %s (%.1f MB each)", self.qpc.path, [d.qid for d in devices], per_device / 2**20
        )
        return QStatus.SUCCESS

    def activate(self) -> QStatus:
        """Take ``-aic-num-cores`` NSP cores on every device of the group."""
        if not self.loaded or self._stale():
            status = self.load()
            if status != QStatus.SUCCESS:
                return status
        if self.active:
            return QStatus.SUCCESS
        cores = self.image.manifest.num_cores
        for dev in self.devices:
            dev.lock.acquire()
        try:
            short = [d for d in self.devices if d.nsp_free < cores]
            if short:
                d = short[0]
                return self._fail(
                    Failure(
                        QStatus.NOSPC,
                        f"not enough NSP cores on QID {d.qid}: the program was compiled with -aic-num-cores={cores} "
                        f"but {d.nsp_free} of {d.nsp_total} are free; deactivate another program or compile with "
                        "fewer cores",
                    )
                )
            for d in self.devices:
                d.nsp_used += cores
        finally:
            for dev in self.devices:
                dev.lock.release()
        self._held["nsp"] = cores
        self._rearm_finalizer()
        self.active = True
        return QStatus.SUCCESS

    def deactivate(self) -> QStatus:
        """Give the NSP cores back; the program stays loaded with its retained state. Runs held on
        its devices (``Queue.enqueue``) execute first."""
        self.machine.run_held(self.devices)
        if self.active:
            _free(self.devices, self.generations, self._held["nsp"], 0)
            self._held["nsp"] = 0
            self._rearm_finalizer()
            self.active = False
        return QStatus.SUCCESS

    def unload(self) -> QStatus:
        """Deactivate, then give DDR back and drop the retained state."""
        self.deactivate()
        if self.loaded:
            self._release()
        return QStatus.SUCCESS

    def _release(self) -> None:
        if self._finalizer is not None:
            self._finalizer.detach()
        _free(self.devices, self.generations, self._held["nsp"], self._held["dram"])
        self._held = {"nsp": 0, "dram": 0}
        self.loaded = self.active = False
        self.state = {}

    def _rearm_finalizer(self) -> None:
        if self._finalizer is not None:
            self._finalizer.detach()
        self._finalizer = weakref.finalize(
            self, _free, self.devices, list(self.generations), self._held["nsp"], self._held["dram"]
        )

    def check_runnable(self) -> None:
        """Raise the failure a run would get now (not loaded, not active, device reset)."""
        if self.loaded and self._stale():
            raise Failure(
                QStatus.DEV_ERROR,
                f"device reset on QIDs {[d.qid for d, g in zip(self.devices, self.generations, strict=True) if d.generation != g]}: "
                "the program lost its resources; load() it again",
            )
        if not self.loaded:
            raise Failure(QStatus.INVAL, "the program is not loaded: call load() and activate()")
        if not self.active:
            raise Failure(QStatus.INVAL, "the program is not activated: call activate()")

    # -- retained state ------------------------------------------------------------------
    def state_array(self, b: Binding, dims: tuple[int, ...]) -> np.ndarray:
        """The retained state of input ``b`` at ``dims`` (zeros before the first run)."""
        held = self.state.get(b.name)
        if held is None:
            arr = np.zeros(dims, dtype=b.dtype)
            self.state[b.name] = arr
            return arr
        arr = self.state_values(mx.decode_mxint8(held)) if isinstance(held, mx.MxTensor) else held
        if arr.shape != dims:
            grown = np.zeros(dims, dtype=arr.dtype)
            region = tuple(slice(0, min(a, n)) for a, n in zip(arr.shape, dims, strict=True))
            grown[region] = arr[region]
            arr = grown
        return arr

    def state_values(self, arr: np.ndarray) -> np.ndarray:
        """Values the host hands to retained state, as the program's datapath holds them.

        An fp16 program (-convert-to-fp16) rounds float32 values to fp16 here, on the way in: its
        graph does not round retained-state inputs, so the state it updates in place stays exactly
        the fp16 values the card would hold.
        """
        if self.image.manifest.convert_to_fp16 and arr.dtype == np.float32:
            return mx.round_fp16(arr)
        return arr

    def holds(self, b: Binding, arr: np.ndarray) -> bool:
        """``arr`` is the retained state of input ``b`` as held, writable in place (C-contiguous)."""
        return self.state.get(b.name) is arr and arr.flags.c_contiguous and arr.flags.writeable

    def store_state(self, b: Binding, value: np.ndarray) -> None:
        """Keep ``value`` as the retained state of input ``b`` in the device's storage format."""
        m = self.image.manifest
        if m.precisions.get(b.name) == "mxint8":
            prev = self.state.get(b.name)
            x = np.asarray(value, dtype=np.float32)
            # Only the blocks a run changed are encoded again; the rest keep their codes.
            self.state[b.name] = (
                mx.update(prev, x) if isinstance(prev, mx.MxTensor) else mx.encode_mxint8(x, axis=-1)
            )
        elif m.convert_to_fp16 and value.dtype == np.float32:
            # The fp16 datapath already made these fp16 values; keeping them as float32 saves two
            # conversions per run and changes no value.
            self.state[b.name] = value
        elif value.dtype != b.dtype:
            self.state[b.name] = value.astype(b.dtype)
        else:
            self.state[b.name] = value

    # -- slicing -------------------------------------------------------------------------
    def createSlicingSpecHandle(self, spec_json: str) -> tuple[QStatus, SlicingSpecHandle | None]:
        """Parse ``{"BufferSpecs": [{"Name": regex, "ElemSize": n, "DimSpecs": [{"start": ...}]}]}``."""
        try:
            data = json.loads(spec_json)
            specs = []
            for entry in data["BufferSpecs"]:
                pattern = re.compile(str(entry["Name"]))
                starts = tuple(d["start"] for d in entry["DimSpecs"])
                if not any(pattern.fullmatch(b.name) for b in self.image.bindings):
                    raise Failure(QStatus.INVAL, f"slicing spec name {entry['Name']!r} matches no binding")
                specs.append(SliceSpec(pattern, int(entry.get("ElemSize", 0)), starts))
        except Failure as exc:
            return self._fail(exc), None
        except (ValueError, KeyError, TypeError, re.error) as exc:
            return self._fail(Failure(QStatus.INVAL, f"invalid slicing spec JSON: {exc}")), None
        return QStatus.SUCCESS, SlicingSpecHandle(specs)
