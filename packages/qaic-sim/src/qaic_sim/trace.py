"""Per-run traces in the runtime's layout plus a Chrome/Perfetto ``trace.json``.

While tracing is on, run ``n`` writes ``<dir>/lrt_trace_<n>/summary.json``, and stopping (or exit)
writes ``<dir>/trace.json`` with one host event (from the enqueue to the end of the run) and one
device event (the modelled run, from when the device started it) per run. Each machine has one
:class:`Tracer`; turn it on with ``QAIC_SIM_TRACE_DIR``, the ``trace_dir`` config key, or
``get_machine().trace.start(dir)`` / ``.stop()`` (vLLM's profiler writes one
``lrt_trace_iter{N}_pid{P}`` directory per profiled span through the backend's ``trace`` control).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("qaic.sim.trace")

FLUSH_EVERY = 200


@dataclass
class RunRecord:
    """What one ExecObj run did, as a trace records it."""

    program: str
    specialization: str
    spec_index: int
    qids: list[int]
    status: int
    start_s: float
    wall_s: float
    device_time_s: float
    queue: int
    exec_obj: int
    bytes_in: int = 0
    bytes_out: int = 0
    message: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    device_start_s: float | None = None
    """When the device started the run (``start_s`` is when the host enqueued it); None: at ``start_s``."""


class TraceRecorder:
    """Writes the per-run directories and collects Chrome trace events."""

    def __init__(self, root: Path, run_dirs: bool = True) -> None:
        self.root = Path(root)
        self.run_dirs = run_dirs
        self.root.mkdir(parents=True, exist_ok=True)
        self.count = 0
        self.events: list[dict[str, Any]] = []
        self.origin = time.perf_counter()
        self.pid = os.getpid()
        self._lock = threading.Lock()
        self._threads: set[int] = set()

    def record(self, run: RunRecord) -> None:
        with self._lock:
            self.count += 1
            n = self.count
            if self.run_dirs:
                run_dir = self.root / f"lrt_trace_{n}"
                run_dir.mkdir(exist_ok=True)
                (run_dir / "summary.json").write_text(json.dumps({"run": n, **asdict(run)}, indent=1))
            ts = (run.start_s - self.origin) * 1e6
            device_ts = ts if run.device_start_s is None else (run.device_start_s - self.origin) * 1e6
            args = {"run": n, "status": run.status, "specialization": run.specialization, "qids": run.qids}
            for qid in run.qids:
                self._thread_names(qid)
                self.events.append(
                    {"name": f"host {run.specialization}", "cat": "host", "ph": "X", "ts": ts,
                     "dur": run.wall_s * 1e6, "pid": self.pid, "tid": 2 * qid, "args": args}
                )  # fmt: skip
                self.events.append(
                    {"name": f"device {run.specialization}", "cat": "device", "ph": "X", "ts": device_ts,
                     "dur": run.device_time_s * 1e6, "pid": self.pid, "tid": 2 * qid + 1, "args": args}
                )  # fmt: skip
            if n % FLUSH_EVERY == 0:
                self._write()

    def _thread_names(self, qid: int) -> None:
        if qid in self._threads:
            return
        self._threads.add(qid)
        for tid, label in ((2 * qid, f"QID {qid} host"), (2 * qid + 1, f"QID {qid} device (modelled)")):
            self.events.append(
                {"name": "thread_name", "ph": "M", "pid": self.pid, "tid": tid, "args": {"name": label}}
            )

    def _write(self) -> Path:
        path = self.root / "trace.json"
        meta = {"name": "process_name", "ph": "M", "pid": self.pid, "tid": 0, "args": {"name": "qaic-sim"}}
        path.write_text(json.dumps({"traceEvents": [meta, *self.events], "displayTimeUnit": "ms"}))
        return path

    def close(self) -> Path:
        with self._lock:
            path = self._write()
        log.info("trace of %d runs written to %s", self.count, self.root)
        return path


class Tracer:
    """One machine's tracing: the current recorder, started by :meth:`start` or the configured directory."""

    def __init__(self, trace_dir: Path | None = None) -> None:
        self._trace_dir = trace_dir
        self._lock = threading.Lock()
        self._recorder: TraceRecorder | None = None

    def start(self, directory: str | os.PathLike[str], run_dirs: bool = True) -> TraceRecorder:
        """Begin tracing every run into ``directory`` (stopping any earlier trace).

        ``run_dirs=False`` keeps only ``trace.json`` (no ``lrt_trace_<n>`` directory per run), so
        tracing adds little to each run's host time.
        """
        recorder = TraceRecorder(Path(directory), run_dirs)
        with self._lock:
            self._trace_dir = None  # an explicit trace replaces the configured one
            previous, self._recorder = self._recorder, recorder
        if previous is not None:
            previous.close()
        log.info("tracing runs into %s", directory)
        return recorder

    def stop(self) -> Path | None:
        """Stop tracing; returns the path of the written ``trace.json``, or None when none was active."""
        with self._lock:
            self._trace_dir = None
            recorder, self._recorder = self._recorder, None
        return recorder.close() if recorder is not None else None

    def recorder(self) -> TraceRecorder | None:
        """The current recorder; the first call starts one when the config names a trace dir."""
        with self._lock:
            if self._trace_dir is not None:
                self._recorder = TraceRecorder(self._trace_dir)
                log.info("tracing runs into %s (configured)", self._trace_dir)
                self._trace_dir = None
            return self._recorder

    @property
    def active(self) -> bool:
        """Whether runs are traced now (a configured trace dir counts from the first run)."""
        return self._recorder is not None or self._trace_dir is not None
