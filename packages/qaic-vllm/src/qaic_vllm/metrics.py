"""The card's own series on vLLM's ``/metrics``: device busy fraction, runs, faults, reloads, compile cache.

vLLM V1 runs each engine core (one per data-parallel rank) in its own process, away from the API
server that answers ``/metrics``. Each engine core's worker keeps a :class:`CardMetrics` (an
observer registered through the ``qaic_observers`` hook, so the stack reports to it without being
patched) and writes a small snapshot file for its device group into ``QAIC_METRICS_DIR`` once a
second. The API server registers :class:`CardMetricsCollector` with ``prometheus_client``'s
default registry, the one vLLM serves ``/metrics`` from, and reads every snapshot at each scrape.
Nothing of vLLM's is patched: the collector is prometheus_client's public custom-collector interface.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client import Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import REGISTRY, Collector

from qaic_core import get_plugin_manager, hookimpl
from qaic_core.descriptors import DeviceBackend
from qaic_core.observe import Observer, StepRecord
from qaic_core.resources import group_ids
from qaic_core.settings import CompileSettings
from qaic_core.types import QStatus
from qaic_vllm.data_parallel import data_parallel_rank

log = logging.getLogger("qaic.vllm.metrics")

QAIC_METRICS_DIR = "QAIC_METRICS_DIR"
"""Where engine cores write their snapshots and the API server reads them (a temporary folder by default)."""
MADE_BY = "QAIC_METRICS_DIR_MADE_BY"
"""``pid:folder`` of the process that made ``QAIC_METRICS_DIR`` a temporary folder (unset: the user chose it)."""
WRITE_INTERVAL_S = 1.0
LABELS = ("dp_rank", "device_group")


@dataclass(frozen=True)
class Series:
    """One exported series: its name as Prometheus shows it, its type and what it measures."""

    name: str
    kind: str
    help: str
    key: str
    """The snapshot field it is read from."""


SERIES = (
    Series("qaic_device_busy_fraction", "gauge", "Modelled device time over wall time in the last second (decays to 0 when idle)", "busy"),
    Series("qaic_device_runs_total", "counter", "Device runs handed over by this engine", "runs"),
    Series("qaic_device_modelled_seconds_total", "counter", "Device time by the runtime's counters (modelled on the simulator)", "device_s"),
    Series("qaic_device_wall_seconds_total", "counter", "Wall time of device runs by the runtime's counters", "wall_s"),
    Series("qaic_kv_retained_bytes", "gauge", "KV bytes the device retains for the requests held (a full context each)", "kv_bytes"),
    Series("qaic_device_faults_total", "counter", "Device faults, by kind (the runtime status)", "faults"),
    Series("qaic_program_reloads_total", "counter", "Program reloads after a device fault", "reloads"),
    Series("qaic_compile_cache_hits_total", "counter", "Programs taken from the compile cache", "cache_hits"),
    Series("qaic_compile_cache_misses_total", "counter", "Programs compiled because the cache had none", "cache_misses"),
    Series("qaic_compile_seconds_total", "counter", "Seconds spent compiling programs", "compile_s"),
)  # fmt: skip
"""Every card series; the Grafana dashboard (docs/grafana/qaic-dashboard.json) uses exactly these."""


def kv_bytes_per_request(vllm_config: Any) -> int:
    """KV bytes one held request retains on the device: every layer's K and V over the whole context."""
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    layers = int(model.get_num_layers(parallel))
    heads = int(model.get_num_kv_heads(parallel))
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    itemsize = int(model.dtype.itemsize) if cache_dtype == "auto" else 1  # fp8 / mxint8 KV: one byte
    return 2 * layers * heads * int(model.get_head_size()) * int(model.max_model_len) * itemsize


class CardMetrics(Observer):
    """One engine core's device-group counters, written to ``QAIC_METRICS_DIR`` by a daemon thread."""

    def __init__(
        self,
        directory: Path,
        dp_rank: int,
        device_group: Sequence[int],
        backend: DeviceBackend | None = None,
        kv_bytes_per_request: int = 0,
        interval: float = WRITE_INTERVAL_S,
    ) -> None:
        self.labels = {"dp_rank": str(dp_rank), "device_group": ",".join(str(q) for q in device_group)}
        self.path = Path(directory) / f"dp{dp_rank}-group{'-'.join(str(q) for q in device_group)}.json"
        self.device_group = tuple(int(q) for q in device_group)
        self.backend = backend
        self.kv_per_request = kv_bytes_per_request
        self.interval = interval
        self.lock = threading.Lock()
        self.writing = threading.Lock()
        self._util: Any = None
        self.counts: dict[str, float] = {
            "runs": 0,
            "reloads": 0,
            "cache_hits": 0,
            "cache_misses": 0,
            "compile_s": 0.0,
        }
        self.faults: dict[str, int] = {}
        self.kv_bytes = 0
        self.last_step = self.step_seconds = 0.0
        self.window = (time.time(), self.device_times()[0])
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="qaic-metrics", daemon=True)

    # -- the stack reports here (the qaic_observers hook) ----------------------------------------
    @hookimpl
    def qaic_observers(self) -> list[Observer]:
        return [self]

    def run_submitted(self, inputs: Mapping[str, np.ndarray], exec_index: int, seconds: float) -> None:
        with self.lock:
            self.counts["runs"] += 1

    def step(self, record: StepRecord) -> None:
        self.last_step = time.monotonic()
        self.kv_bytes = record.running * self.kv_per_request

    def held_kv_bytes(self) -> int:
        """The last step's held requests' KV; none once steps stopped (vLLM steps while any request is held)."""
        quiet = time.monotonic() - self.last_step
        return self.kv_bytes if quiet <= 2 * self.interval + 2 * self.step_seconds else 0

    def phase(self, name: str, seconds: float) -> None:
        if name == "runner":
            self.step_seconds = seconds

    def program_compiled(self, cached: bool, seconds: float) -> None:
        with self.lock:
            self.counts["cache_hits" if cached else "cache_misses"] += 1
            self.counts["compile_s"] += seconds
        self.write()

    def device_fault(self, kind: str) -> None:
        with self.lock:
            self.faults[kind] = self.faults.get(kind, 0) + 1
        self.write()

    def program_reloaded(self) -> None:
        with self.lock:
            self.counts["reloads"] += 1
        self.write()

    # -- snapshots --------------------------------------------------------------------------------
    def device_times(self) -> tuple[float, float]:
        """(modelled, wall) device seconds so far, the mean over the group's QIDs (0 without counters)."""
        if self.backend is None or not self.device_group:
            return 0.0, 0.0
        modelled = wall = 0.0
        for qid in self.device_group:
            try:
                status, info = self.util().getPerformanceInfo(qid)
            except (AttributeError, NotImplementedError):  # a runtime without performance counters
                return 0.0, 0.0
            if int(status) == QStatus.SUCCESS and info is not None:
                modelled += float(getattr(info, "deviceTimeS", 0.0))
                wall += float(getattr(info, "wallTimeS", 0.0))
        return modelled / len(self.device_group), wall / len(self.device_group)

    def util(self) -> Any:
        if self._util is None:
            assert self.backend is not None
            self._util = self.backend.runtime().Util()
        return self._util

    def snapshot(self) -> dict[str, Any]:
        """What the collector reads: counters, and the busy window (start, device seconds in it)."""
        now = time.time()
        modelled, wall = self.device_times()
        start, before = self.window
        self.window = (now, modelled)
        with self.lock:
            return {
                **self.counts,
                "labels": self.labels,
                "faults": dict(self.faults),
                "kv_bytes": self.held_kv_bytes(),
                "device_s": modelled,
                "wall_s": wall,
                "window_start": start,
                "window_device_s": max(modelled - before, 0.0),
                "written": now,
                "host": socket.gethostname(),
                "pid": os.getpid(),
            }

    def write(self) -> None:
        """Replace the snapshot file atomically, so a scrape never reads half of one."""
        try:
            with self.writing:
                data = json.dumps(self.snapshot())
                tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(data)
                os.replace(tmp, self.path)
        except FileNotFoundError:  # the folder was removed at exit before this last write
            log.debug("qaic: card metrics folder %s is gone", self.path.parent)
        except OSError as exc:
            log.warning("qaic: cannot write card metrics to %s: %s", self.path, exc)

    def _run(self) -> None:
        while not self.stopped.wait(self.interval):
            self.write()

    def start(self) -> CardMetrics:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.write()
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopped.set()
        if self.thread.is_alive():
            self.thread.join(timeout=5)
        self.write()


def start_card_metrics(vllm_config: Any, settings: CompileSettings, backend: DeviceBackend) -> CardMetrics:
    """The worker's metrics for its device group, registered with the plugin manager before the model opens.

    The data-parallel rank is vLLM's ``parallel_config.data_parallel_index`` (the global rank: vLLM
    turns each dense-model replica's ``data_parallel_rank`` into 0), else ``data_parallel_rank``, 0
    without data parallelism; the device group is the QIDs the engine's program runs on.
    """
    device_group = group_ids(settings.device_group, settings.num_devices)
    rank = data_parallel_rank(vllm_config.parallel_config)
    try:
        per_request = kv_bytes_per_request(vllm_config)
    except (AttributeError, TypeError, ValueError) as exc:
        log.warning("qaic: KV bytes per request unknown (%s); qaic_kv_retained_bytes stays 0", exc)
        per_request = 0
    metrics = CardMetrics(metrics_dir(), rank, device_group, backend, per_request)
    get_plugin_manager().register(metrics, name=f"qaic-card-metrics-{id(metrics)}")
    return metrics.start()


def stop_card_metrics(metrics: CardMetrics | None) -> None:
    """Write the last snapshot and take the metrics out of the plugin manager."""
    if metrics is None:
        return
    metrics.stop()
    pm = get_plugin_manager()
    if pm.is_registered(metrics):
        pm.unregister(metrics)


def metrics_dir() -> Path:
    """``QAIC_METRICS_DIR``, made a fresh temporary folder (removed at exit) when unset.

    ``vllm serve`` claims its own before it starts the engine cores (:func:`claim_metrics_dir`), so
    they inherit the same folder.
    """
    value = os.environ.get(QAIC_METRICS_DIR)
    return Path(value) if value else make_metrics_dir()


def claim_metrics_dir() -> Path:
    """The folder of this ``vllm serve`` (called where vLLM builds its command line, in the CLI process).

    A folder the user chose is kept; one another process made for itself (a parent that ran vLLM
    in-process, another server that started this one) is not shared: this server makes its own.
    """
    value = os.environ.get(QAIC_METRICS_DIR)
    made_by = os.environ.get(MADE_BY, "")
    if not value or (made_by.endswith(f":{value}") and made_by != f"{os.getpid()}:{value}"):
        return make_metrics_dir()
    return Path(value)  # the user's, or this process's own


def make_metrics_dir() -> Path:
    folder = tempfile.mkdtemp(prefix="qaic-metrics-")
    os.environ[QAIC_METRICS_DIR] = folder
    os.environ[MADE_BY] = f"{os.getpid()}:{folder}"
    atexit.register(remove_folder, folder, os.getpid())
    return Path(folder)


def remove_folder(folder: str, owner: int) -> None:
    """Remove the snapshot folder at exit, in the process that made it only (forked children inherit atexit)."""
    if os.getpid() == owner:
        shutil.rmtree(folder, ignore_errors=True)


class CardMetricsCollector(Collector):
    """Yields :data:`SERIES` from every snapshot in the folder at each scrape."""

    def __init__(self, directory: Path | None = None, clock: Any = time.time) -> None:
        self.fixed = Path(directory) if directory is not None else None
        self.clock = clock

    @property
    def directory(self) -> Path | None:
        """The folder given, else ``QAIC_METRICS_DIR`` as it is now (None when unset: no snapshots)."""
        if self.fixed is not None:
            return self.fixed
        value = os.environ.get(QAIC_METRICS_DIR)
        return Path(value) if value else None

    def snapshots(self) -> list[dict[str, Any]]:
        """Every snapshot in the folder but those a process of this host wrote and has since ended."""
        found = []
        host = socket.gethostname()
        directory = self.directory
        for path in sorted(directory.glob("dp*-group*.json")) if directory is not None else []:
            try:
                snap = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                log.debug("qaic: skipping card metrics %s: %s", path, exc)
                continue
            if snap.get("host") != host or process_alive(int(snap.get("pid", 0))):
                found.append(snap)
        return found

    def rows(self) -> Iterator[tuple[Series, list[str], list[str], float]]:
        """(series, label names, label values, value) of every sample the snapshots give now."""
        snapshots = self.snapshots()
        now = self.clock()
        for series in SERIES:
            names = [*LABELS, "kind"] if series.key == "faults" else list(LABELS)
            for snap in snapshots:
                values = [str(snap["labels"][name]) for name in LABELS]
                if series.key == "faults":
                    for kind, count in sorted(snap["faults"].items()):
                        yield series, names, [*values, kind], float(count)
                elif series.key == "busy":
                    yield series, names, values, busy_fraction(snap, now)
                else:
                    yield series, names, values, float(snap[series.key])

    def collect(self) -> Iterator[Metric]:
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        for series in SERIES:
            names = [*LABELS, "kind"] if series.key == "faults" else list(LABELS)
            kind = GaugeMetricFamily if series.kind == "gauge" else CounterMetricFamily
            families[series.name] = kind(series.name, series.help, labels=names)
        for series, _, values, value in self.rows():
            families[series.name].add_metric(values, value)
        yield from families.values()


class MultiprocessMirror:
    """The snapshots copied into prometheus_client gauges once a second, for its multiprocess mode.

    With ``PROMETHEUS_MULTIPROC_DIR`` set (vLLM sets it for ``--api-server-count`` above 1, which
    data parallelism defaults to), ``/metrics`` shows only what processes wrote into that folder,
    so each API server writes the card series there as gauges (``mostrecent``: every server
    writes the same values, the newest is shown). Counters are gauges in this mode.
    """

    def __init__(self, collector: CardMetricsCollector, interval: float = WRITE_INTERVAL_S) -> None:
        self.collector = collector
        self.interval = interval
        self.gauges: dict[str, Gauge] = {}
        self.thread = threading.Thread(target=self._run, name="qaic-metrics-mirror", daemon=True)

    def mirror(self) -> None:
        for series, names, values, value in self.collector.rows():
            gauge = self.gauges.get(series.name)
            if gauge is None:
                gauge = Gauge(series.name, series.help, names, registry=None, multiprocess_mode="mostrecent")
                self.gauges[series.name] = gauge
            gauge.labels(*values).set(value)

    def _run(self) -> None:
        while True:
            try:
                self.mirror()
            except Exception as exc:  # a metrics problem must never stop the server
                log.warning("qaic: card metrics not mirrored: %s", exc)
            time.sleep(self.interval)

    def start(self) -> MultiprocessMirror:
        self.thread.start()
        return self


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return pid > 0


def busy_fraction(snap: Mapping[str, Any], now: float) -> float:
    """Device seconds in the snapshot's window over the time since the window began, in [0, 1].

    Between snapshots the window grows with no device time added: an idle device decays to 0.
    """
    elapsed = max(now, float(snap["written"])) - float(snap["window_start"])
    if elapsed <= 0:
        return 0.0
    return min(max(float(snap["window_device_s"]) / elapsed, 0.0), 1.0)


_served: list[CardMetricsCollector] = []


def serve_card_metrics() -> None:
    """Put the card series on the registry vLLM's API server serves (once per process).

    The default registry gets the collector; under prometheus_client's multiprocess mode
    (``PROMETHEUS_MULTIPROC_DIR``) a :class:`MultiprocessMirror` writes them into that folder too.
    """
    if _served:
        return
    collector = CardMetricsCollector()
    REGISTRY.register(collector)
    _served.append(collector)
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        MultiprocessMirror(collector).start()
