"""Per-iteration device traces for ``worker.profile`` when ``VLLM_TORCH_PROFILER_DIR`` is set."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from qaic_core.controls import TraceControl
from qaic_core.descriptors import DeviceBackend

log = logging.getLogger("qaic.vllm.profile")

PROFILER_DIR_ENV = "VLLM_TORCH_PROFILER_DIR"


class IterationTracer:
    """Writes ``lrt_trace_iter{N}_pid{P}`` under the profiler dir for each step while profiling.

    The directory is ``VLLM_TORCH_PROFILER_DIR``, else ``--profiler-config``'s ``torch_profiler_dir``.
    """

    def __init__(self, backend: DeviceBackend | None, fallback_dir: str = "") -> None:
        self.backend = backend
        self.fallback_dir = fallback_dir
        self.root: Path | None = None
        self.control: TraceControl | None = None
        self.active = False
        self.iteration = 0
        self._open = False

    def start(self) -> None:
        raw = os.environ.get(PROFILER_DIR_ENV, "").strip() or self.fallback_dir.strip()
        self.root = Path(raw).expanduser() if raw else None
        self.control = self.backend.trace if self.backend is not None and self.root is not None else None
        if self.root is None:
            log.info(
                "%s is not set (nor --profiler-config torch_profiler_dir): profiling is off", PROFILER_DIR_ENV
            )
            return
        if self.control is None:
            log.warning("the qaic backend records no traces; profiling writes nothing")
        self.root.mkdir(parents=True, exist_ok=True)
        self.active = True
        log.info("profiling started: per-iteration traces under %s", self.root)

    def stop(self) -> None:
        self.end_iteration()
        if self.active:
            log.info("profiling stopped after %d iterations", self.iteration)
        self.active = False

    def begin_iteration(self) -> None:
        if not self.active or self.root is None or self.control is None:
            return
        directory = self.root / f"lrt_trace_iter{self.iteration}_pid{os.getpid()}"
        directory.mkdir(parents=True, exist_ok=True)
        self.control.start(directory)
        self._open = True
        self.iteration += 1

    def end_iteration(self) -> None:
        if self._open and self.control is not None:
            self.control.stop()
        self._open = False
