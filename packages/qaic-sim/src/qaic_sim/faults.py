"""Fault injection: device resets, timeouts, device errors and out-of-memory at load.

A fault fires on one QID at a given count of runs (or loads) on that QID, counted from when the
fault was armed. Kinds:

- ``reset``: the QID is reset before run N; programs on it fail with DEV_ERROR until loaded again.
- ``timeout``: run N fails with TIMEDOUT.
- ``dev_error``: run N fails with DEV_ERROR.
- ``nomem``: load N fails with NOMEM.

Configure with ``QAIC_SIM_FAULTS`` (``reset@0:run=3,nomem@1:load=1`` or a JSON list), the
``faults`` list of the ``QAIC_SIM_CONFIG`` file, or ``get_machine().faults.inject(...)`` from tests
(each :class:`qaic_sim.machine.SimMachine` has its own :class:`FaultPlan`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from qaic_core.errors import QaicConfigError
from qaic_core.types import QStatus
from qaic_sim.topology import Topology

log = logging.getLogger("qaic.sim.faults")

KINDS = {"reset": "run", "timeout": "run", "dev_error": "run", "nomem": "load"}


@dataclass
class Fault:
    """One armed fault: fires once when the QID's counter reaches ``at``."""

    kind: str
    qid: int
    at: int
    fired: bool = False


def _parse(entry: Mapping[str, Any]) -> tuple[str, int, int]:
    kind = str(entry.get("kind", "")).strip().lower().replace("-", "_")
    if kind not in KINDS:
        raise QaicConfigError(f"fault {dict(entry)}: kind must be one of {sorted(KINDS)}")
    counter = KINDS[kind]
    extra = set(entry) - {"kind", "qid", counter, "at"}
    if extra:
        raise QaicConfigError(
            f"fault {dict(entry)}: unknown keys {sorted(extra)}; a {kind} fault takes qid and {counter}"
        )
    try:
        qid = int(entry.get("qid", 0))
        at = int(entry.get(counter, entry.get("at", 1)))
    except (TypeError, ValueError):
        raise QaicConfigError(f"fault {dict(entry)}: qid and {counter} must be integers") from None
    if qid < 0 or at < 1:
        raise QaicConfigError(f"fault {dict(entry)}: qid must be >= 0 and {counter} >= 1")
    return kind, qid, at


class FaultPlan:
    """The faults armed on one machine's devices; each fires once, when its QID's counter reaches it."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self._lock = threading.Lock()
        self._faults: list[Fault] = []

    def configure(self, entries: tuple[Mapping[str, Any], ...], where: str = "QAIC_SIM_FAULTS") -> None:
        """Arm the faults of the simulator config (``QAIC_SIM_FAULTS`` or the file's ``faults``)."""
        for entry in entries:
            try:
                kind, qid, at = _parse(entry)
            except QaicConfigError as exc:
                raise QaicConfigError(f"{where}: {exc}") from None
            self.inject(kind, qid, at)

    def inject(self, kind: str, qid: int = 0, at: int = 1) -> Fault:
        """Arm a fault on visible QID ``qid`` at the ``at``-th next run (or load for nomem)."""
        kind, qid, at = _parse({"kind": kind, "qid": qid, "at": at})
        dev = self.topology.device(qid)
        if dev is None:
            raise QaicConfigError(f"fault {kind}: QID {qid} does not exist; devices: {self.topology.ids()}")
        base = dev.loads if KINDS[kind] == "load" else dev.runs
        fault = Fault(kind, qid, base + at)
        with self._lock:
            self._faults.append(fault)
        log.info("armed fault %s on QID %d at %s %d", kind, qid, KINDS[kind], base + at)
        return fault

    def reset_device(self, qid: int) -> None:
        """Reset QID ``qid`` now, as a host-initiated device reset would."""
        dev = self.topology.device(qid)
        if dev is None:
            raise QaicConfigError(f"reset: QID {qid} does not exist; devices: {self.topology.ids()}")
        dev.reset()

    def clear(self) -> None:
        """Disarm every fault."""
        with self._lock:
            self._faults.clear()

    def armed(self) -> list[Fault]:
        """The faults that have not fired yet."""
        with self._lock:
            return [f for f in self._faults if not f.fired]

    def on_run(self, qid: int, count: int) -> QStatus | None:
        """Status forced on run ``count`` of QID ``qid``, or None; a reset fault resets the QID."""
        fault = self._take(qid, count, ("reset", "timeout", "dev_error"))
        if fault is None:
            return None
        log.warning("fault %s fires on QID %d at run %d", fault.kind, qid, count)
        if fault.kind == "reset":
            self.reset_device(qid)
            return QStatus.DEV_ERROR
        return QStatus.TIMEDOUT if fault.kind == "timeout" else QStatus.DEV_ERROR

    def on_load(self, qid: int, count: int) -> bool:
        """Whether load ``count`` on QID ``qid`` must fail with NOMEM."""
        fault = self._take(qid, count, ("nomem",))
        if fault is not None:
            log.warning("fault nomem fires on QID %d at load %d", qid, count)
        return fault is not None

    def _take(self, qid: int, count: int, kinds: tuple[str, ...]) -> Fault | None:
        with self._lock:
            for fault in self._faults:
                if not fault.fired and fault.qid == qid and fault.kind in kinds and fault.at == count:
                    fault.fired = True
                    return fault
        return None
