"""The card's series on a real ``vllm serve``'s ``/metrics``, and the Grafana dashboard that reads them.

One server on 127.0.0.1 with the tiny Llama and a fault plan (``QAIC_SIM_FAULTS``) that fails one
run on QID 0: OpenAI clients stream completions until the fault fires, then ``/metrics`` must hold
every card series with values the workload implies (runs at least the tokens one request needed,
the fault under its kind with one program reload, the program compiled or taken from the cache once).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
import served_completions
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from served_completions import fault_plan, openai_client
from vllm_server import VllmServer

from qaic_vllm.metrics import (
    MADE_BY,
    QAIC_METRICS_DIR,
    SERIES,
    CardMetrics,
    CardMetricsCollector,
    busy_fraction,
    claim_metrics_dir,
    data_parallel_rank,
)

pytestmark = pytest.mark.serve

MODEL = "tiny-metrics"
FAULT_RUN = 250
ARGS = [
    "--served-model-name", MODEL,
    "--max-model-len", "256",
    "--max-num-seqs", "4",
    "--long-prefill-token-threshold", "16",
    "--dtype", "float32",
]  # fmt: skip
KV_PER_REQUEST = 2 * 2 * 2 * 16 * 256 * 4
"""K and V x 2 layers x 2 KV heads x head size 16 (64 / 4 heads) x 256 positions x 4 bytes (float32)."""
DASHBOARD = Path(__file__).resolve().parents[3] / "docs" / "grafana" / "qaic-dashboard.json"
LABELS = {"dp_rank": "0", "device_group": "0"}


def samples(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Every qaic sample on ``/metrics``, by sample name, as Prometheus' own parser reads the page."""
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name.startswith("qaic_"):
                found.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return found


def value(found: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float:
    """The one sample of ``name`` with these labels (besides dp_rank and device_group)."""
    want = LABELS | labels
    matches = [v for got, v in found.get(name, []) if got == want]
    assert len(matches) == 1, (name, want, found.get(name))
    return matches[0]


def stream(client: openai.OpenAI, i: int, max_tokens: int) -> str | None:
    """Stream one completion; the error's message, or None when it finished."""
    prompt = [(13 * i + 7 * k) % 800 + 11 for k in range(5 + 3 * i)]
    return served_completions.stream(client, MODEL, prompt, max_tokens)[1]


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    folder = tmp_path_factory.mktemp("serve-metrics")
    # No QAIC_METRICS_DIR: the server makes its own folder, as it does for a user.
    env = {"QAIC_SIM_FAULTS": fault_plan({"dev_error": FAULT_RUN})}
    srv = VllmServer(tiny_model, ARGS, folder / "vllm-serve.log", env=env)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def served(server: VllmServer) -> dict[str, object]:
    """Load the server until the fault fired; what /metrics showed while it served, and after."""
    client = openai_client(server.url)
    busy: list[float] = []
    kv: list[float] = []
    errors: list[str] = []
    started = time.monotonic()
    # Waves of four streams until the fault fired and for 5 s at least (five snapshots or more).
    while (not errors or time.monotonic() - started < 5) and time.monotonic() - started < 300:
        with ThreadPoolExecutor(5) as pool:
            results = [pool.submit(stream, client, i, 100) for i in range(4)]
            while not all(r.done() for r in results):
                now = samples(server.url)
                busy.append(value(now, "qaic_device_busy_fraction"))
                kv.append(value(now, "qaic_kv_retained_bytes"))
                time.sleep(0.2)
        errors += [e for e in (r.result() for r in results) if e is not None]
    assert errors, f"the fault planned for run {FAULT_RUN} never fired"
    assert stream(client, 1, 30) is None  # the server serves on after the reload
    deadline = time.monotonic() + 30
    found = samples(server.url)
    while time.monotonic() < deadline and (
        not found.get("qaic_program_reloads_total") or value(found, "qaic_kv_retained_bytes") != 0
    ):
        time.sleep(0.5)
        found = samples(server.url)
    return {"busy": busy, "kv": kv, "errors": errors, "after": found}


def test_every_card_series_is_served_with_the_workloads_values(served: dict[str, object]) -> None:
    found = served["after"]
    assert isinstance(found, dict)
    exported = {name for name in found}
    assert exported == {s.name for s in SERIES}, exported ^ {s.name for s in SERIES}
    # The fault was planned for the QID's run 250: at least that many ran.
    assert value(found, "qaic_device_runs_total") >= FAULT_RUN
    assert value(found, "qaic_device_modelled_seconds_total") > 0
    assert value(found, "qaic_device_wall_seconds_total") >= 0
    assert value(found, "qaic_device_faults_total", kind="dev_error") == 1
    assert sum(v for _, v in found["qaic_device_faults_total"]) == 1
    assert value(found, "qaic_program_reloads_total") == 1
    # The program was compiled (fresh cache) or taken from the cache (an earlier test compiled it): once.
    hits, misses = (
        value(found, "qaic_compile_cache_hits_total"),
        value(found, "qaic_compile_cache_misses_total"),
    )
    assert (hits, misses) in {(0, 1), (1, 0)}
    assert (value(found, "qaic_compile_seconds_total") > 0) == (misses == 1)
    assert value(found, "qaic_kv_retained_bytes") == 0  # nothing held once the requests ended


def test_busy_fraction_and_retained_kv_follow_the_load(served: dict[str, object]) -> None:
    busy, kv = served["busy"], served["kv"]
    assert isinstance(busy, list) and isinstance(kv, list)
    assert busy and all(0.0 <= b <= 1.0 for b in busy), busy
    assert max(busy) > 0
    # While serving, the device holds a whole context for each of at most 4 requests.
    assert all(k % KV_PER_REQUEST == 0 and 0 <= k <= 4 * KV_PER_REQUEST for k in kv), kv
    assert max(kv) > 0


def dashboard_series() -> dict[str, set[str]]:
    """The qaic series each PromQL expression in the dashboard names, by expression."""
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in board["panels"] for t in panel.get("targets", [])]
    assert exprs, "the dashboard has no queries"
    return {expr: set(re.findall(r"\b(qaic_[a-z0-9_]+)", expr)) for expr in exprs}


def test_the_dashboard_queries_exactly_the_served_series(served: dict[str, object]) -> None:
    found = served["after"]
    assert isinstance(found, dict)
    exported = set(found)
    named = dashboard_series()
    for expr, names in named.items():
        assert names, f"dashboard query {expr!r} names no qaic series"
        assert names <= exported, f"dashboard query {expr!r} names {names - exported}, not on /metrics"
    assert set().union(*named.values()) == exported


def test_the_collector_reads_snapshots_and_drops_those_of_ended_processes(tmp_path: Path) -> None:
    metrics = CardMetrics(tmp_path, dp_rank=1, device_group=[2, 3])
    metrics.device_fault("timedout")
    metrics.program_compiled(cached=False, seconds=2.5)
    registry = CollectorRegistry()
    registry.register(CardMetricsCollector(tmp_path))
    page = generate_latest(registry).decode()
    assert 'qaic_device_faults_total{device_group="2,3",dp_rank="1",kind="timedout"} 1.0' in page
    assert 'qaic_compile_seconds_total{device_group="2,3",dp_rank="1"} 2.5' in page
    snap = json.loads(metrics.path.read_text())
    (tmp_path / "dp7-group9.json").write_text(json.dumps(snap | {"pid": 2**22 + 1}))  # no such process
    assert 'dp_rank="7"' not in generate_latest(registry).decode()


def test_busy_fraction_decays_once_the_device_idles() -> None:
    snap = {"written": 10.0, "window_start": 9.0, "window_device_s": 0.5}
    assert busy_fraction(snap, 10.0) == 0.5
    assert busy_fraction(snap, 13.0) == 0.125
    assert busy_fraction(snap | {"window_device_s": 3.0}, 10.0) == 1.0


MIRROR_SCRIPT = """
import sys
from pathlib import Path
from prometheus_client import CollectorRegistry, generate_latest, multiprocess
from qaic_vllm.metrics import CardMetrics, CardMetricsCollector, MultiprocessMirror

snapshots = Path(sys.argv[1])
metrics = CardMetrics(snapshots, dp_rank=3, device_group=[4])
metrics.device_fault("dev_error")
metrics.program_reloaded()
MultiprocessMirror(CardMetricsCollector(snapshots)).mirror()
registry = CollectorRegistry()
multiprocess.MultiProcessCollector(registry)
print(generate_latest(registry).decode())
"""


def test_under_prometheus_multiprocess_mode_the_series_reach_its_folder(tmp_path: Path) -> None:
    """What vLLM serves with several API servers: only what processes wrote into PROMETHEUS_MULTIPROC_DIR."""
    (tmp_path / "prom").mkdir()
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path / "prom"))
    page = subprocess.run(
        [sys.executable, "-c", MIRROR_SCRIPT, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert 'qaic_device_faults_total{device_group="4",dp_rank="3",kind="dev_error"} 1.0' in page
    assert 'qaic_program_reloads_total{device_group="4",dp_rank="3"} 1.0' in page
    assert {f"# TYPE {s.name} gauge" for s in SERIES} <= set(page.splitlines())


def test_the_rank_label_is_vllms_global_data_parallel_rank() -> None:
    # vLLM sets a dense replica's data_parallel_rank to 0 and keeps the global rank in data_parallel_index.
    assert data_parallel_rank(SimpleNamespace(data_parallel_rank=0, data_parallel_index=2)) == 2
    assert data_parallel_rank(SimpleNamespace(data_parallel_rank=1)) == 1
    assert data_parallel_rank(SimpleNamespace()) == 0


def test_each_server_claims_its_own_snapshot_folder_unless_the_user_chose_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A folder a parent process made for itself is not shared with a server it starts; the user's is."""
    monkeypatch.delenv(QAIC_METRICS_DIR, raising=False)
    monkeypatch.delenv(MADE_BY, raising=False)
    own = claim_metrics_dir()
    assert own.is_dir() and os.environ[QAIC_METRICS_DIR] == str(own)
    assert claim_metrics_dir() == own  # claimed once per process
    monkeypatch.setenv(MADE_BY, f"{os.getpid() + 1}:{own}")  # as a server started by this process sees it
    fresh = claim_metrics_dir()
    assert fresh != own and fresh.is_dir()
    monkeypatch.setenv(QAIC_METRICS_DIR, str(tmp_path))  # the user's choice, whatever MADE_BY says
    assert claim_metrics_dir() == tmp_path
