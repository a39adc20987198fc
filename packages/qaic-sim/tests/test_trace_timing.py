"""Traces (per-run directories and a Chrome trace), modelled device time and pacing."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
from sim_programs import D, compile_program, kv_specs, write_kv_model

from qaic_core.errors import QaicConfigError
from qaic_core.types import SkuType
from qaic_sim import qaicrt, timing
from qaic_sim.config import PACE_PRESETS, load_config
from qaic_sim.machine import get_machine, reset_machine
from qaic_sim.qaicrt import QStatus


@pytest.fixture(scope="module")
def kv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("trace")
    onnx_path, _ = write_kv_model(root / "kv.onnx")
    return compile_program(
        root / "p",
        onnx_path,
        kv_specs(fbs=2, ctx=16, prefill=4),
        flags=("-retained-state", "-convert-to-fp16"),
    )


def _decode_runs(qpc: Path, n: int, qid: int = 0) -> list[float]:
    ctx = qaicrt.Context()
    queue = qaicrt.Queue(ctx, qid)
    program = qaicrt.Program(ctx, qid, qaicrt.Qpc(str(qpc)))
    assert program.load() == QStatus.SUCCESS and program.activate() == QStatus.SUCCESS
    exe = qaicrt.ExecObj(ctx, program)
    walls = []
    for step in range(n):
        x = np.ones((2, 1, D), np.float32)
        exe.setData(
            [
                (0, x),
                (1, np.array([[step], [step]])),
                (2, np.array([[0], [1]])),
                (4, np.zeros((2, D), np.float32)),
            ]
        )
        start = time.perf_counter()
        queue.enqueue(exe)
        assert exe.waitForCompletion() == QStatus.SUCCESS
        walls.append(time.perf_counter() - start)
    program.unload()
    return walls


def test_trace_start_stop_writes_run_dirs_and_chrome_trace(kv: Path, tmp_path: Path) -> None:
    out = tmp_path / "lrt_trace_iter0_pid1"
    get_machine().trace.start(out)
    _decode_runs(kv, 3)
    path = get_machine().trace.stop()
    assert path == out / "trace.json"
    runs = sorted(p.name for p in out.iterdir() if p.is_dir())
    assert runs == ["lrt_trace_1", "lrt_trace_2", "lrt_trace_3"]
    summary = json.loads((out / "lrt_trace_2" / "summary.json").read_text())
    assert summary["run"] == 2 and summary["specialization"] == "Decode" and summary["status"] == 0
    assert summary["qids"] == [0] and summary["device_time_s"] > 0
    events = json.loads(path.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == 6  # one host and one device span per run
    for e in spans:
        assert {"name", "ts", "dur", "pid", "tid"} <= set(e)
    device = [e for e in spans if e["cat"] == "device"]
    assert device[0]["dur"] == pytest.approx(summary["device_time_s"] * 1e6)
    _decode_runs(kv, 1)  # stopped: nothing more is written
    assert not (out / "lrt_trace_4").exists()


def test_trace_dir_from_env(kv: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QAIC_SIM_TRACE_DIR", str(tmp_path / "env-trace"))
    reset_machine()
    _decode_runs(kv, 2)
    assert (tmp_path / "env-trace" / "lrt_trace_2" / "summary.json").is_file()
    get_machine().trace.stop()
    assert (tmp_path / "env-trace" / "trace.json").is_file()


def test_device_time_comes_from_the_timing_model(kv: Path) -> None:
    _decode_runs(kv, 4, qid=1)
    status, perf = qaicrt.Util().getPerformanceInfo(1)
    assert status == QStatus.SUCCESS and perf.numRuns == 4
    program = qaicrt.Program(qaicrt.Context(), 1, qaicrt.Qpc(str(kv)))
    import onnx

    from qaic_sim import qpcfile

    model = onnx.load_from_string(qpcfile.read_member(kv, qpcfile.MODEL))
    cost = timing.ProgramCost.from_onnx(
        model, program.image.manifest.specs[1].symbols, weight_bytes_per_param=2.0, kv_bytes_per_elem=2.0
    )
    expected = timing.device_time_s(cost, timing.HardwareModel.for_device_group(SkuType.ULTRA, 1, 4))
    assert expected > 0
    assert perf.deviceTimeS == pytest.approx(4 * expected)


def test_pace_as_sleeps_for_the_modelled_time(kv: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QAIC_SIM_PACE_AS", "qwen2.5-0.5b")
    reset_machine()
    cost = timing.ProgramCost.for_decoder(
        PACE_PRESETS["qwen2.5-0.5b"],
        batch=2,
        seq_len=1,
        ctx_len=16,
        weight_precision="float16",
        kv_precision="float16",
    )
    modelled = timing.device_time_s(cost, timing.HardwareModel.for_device_group(SkuType.ULTRA, 1, 4))
    assert modelled > 0.005
    walls = _decode_runs(kv, 3)
    assert min(walls) >= modelled
    _status, perf = qaicrt.Util().getPerformanceInfo(0)
    assert perf.deviceTimeS == pytest.approx(3 * modelled)


def _two_exec_objects(
    kv: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[qaicrt.Program, list[tuple[qaicrt.Queue, qaicrt.ExecObj]]]:
    """A paced program (as qwen2.5-0.5b) and two exec objects on their own queues, each with a decode bound."""
    monkeypatch.setenv("QAIC_SIM_PACE_AS", "qwen2.5-0.5b")
    reset_machine()
    ctx = qaicrt.Context()
    program = qaicrt.Program(ctx, 0, qaicrt.Qpc(str(kv)))
    assert program.load() == QStatus.SUCCESS and program.activate() == QStatus.SUCCESS
    pairs = [(qaicrt.Queue(ctx, 0), qaicrt.ExecObj(ctx, program)) for _ in range(2)]
    for i, (_queue, exe) in enumerate(pairs):
        exe.setData(
            [
                (0, np.ones((2, 1, D), np.float32)),
                (1, np.array([[i], [i]])),
                (2, np.array([[0], [1]])),
                (4, np.zeros((2, D), np.float32)),
            ]
        )
    return program, pairs


def test_paced_runs_of_one_program_take_the_device_one_after_another(
    kv: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two exec objects enqueued at once on two queues: the second run's modelled time starts when the
    first has finished (the device runs one execution at a time), so the pair takes both times."""
    program, pairs = _two_exec_objects(kv, monkeypatch)
    start = time.perf_counter()
    for queue, exe in pairs:
        assert queue.enqueue(exe) == QStatus.SUCCESS
    for _queue, exe in pairs:
        assert exe.waitForCompletion() == QStatus.SUCCESS
    wall = time.perf_counter() - start
    modelled = [exe.lastDeviceTimeS for _queue, exe in pairs]
    assert min(modelled) > 0.005
    assert wall >= sum(modelled)
    program.unload()


def test_pace_as_must_name_a_preset_or_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with pytest.raises(QaicConfigError, match="neither a preset"):
        load_config({"QAIC_SIM_PACE_AS": "llama-99b"})
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(PACE_PRESETS["opt-2.7b"]))
    assert load_config({"QAIC_SIM_PACE_AS": str(cfg), "QAIC_SIM_PACE": "1"}).pace


def test_a_paced_run_starts_on_the_device_when_it_is_enqueued(
    kv: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A card starts a run when the host enqueues it; the simulator's queue thread picking it up later
    (it waits for the host's interpreter) does not make the device idle. Enqueued long ago on an idle
    device, a run is already over once computed; enqueued now, it lasts its modelled time."""
    monkeypatch.setenv("QAIC_SIM_PACE_AS", "llama-2-7b")
    reset_machine()
    ctx = qaicrt.Context()
    program = qaicrt.Program(ctx, 0, qaicrt.Qpc(str(kv)))
    assert program.load() == QStatus.SUCCESS and program.activate() == QStatus.SUCCESS
    exe = qaicrt.ExecObj(ctx, program)
    walls = []
    for step, enqueued_ago in enumerate((60.0, 0.0)):
        exe.setData(
            [
                (0, np.ones((2, 1, D), np.float32)),
                (1, np.array([[step], [step]])),
                (2, np.array([[0], [1]])),
                (4, np.zeros((2, D), np.float32)),
            ]
        )
        start = time.perf_counter()
        assert exe.execute(0, enqueued=start - enqueued_ago) == QStatus.SUCCESS
        walls.append(time.perf_counter() - start)
    modelled = exe.lastDeviceTimeS
    assert modelled > 0.05
    assert walls[0] < modelled / 2 <= modelled <= walls[1]
    program.unload()


def test_a_trace_without_run_dirs_shows_queued_runs_one_after_another_on_the_device(
    kv: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Two runs enqueued at once: their host spans start together, their device spans one after the other."""
    program, pairs = _two_exec_objects(kv, monkeypatch)
    get_machine().trace.start(tmp_path / "t", run_dirs=False)
    for queue, exe in pairs:
        assert queue.enqueue(exe) == QStatus.SUCCESS
    for _queue, exe in pairs:
        assert exe.waitForCompletion() == QStatus.SUCCESS
    path = get_machine().trace.stop()
    program.unload()
    assert path is not None and not [p for p in (tmp_path / "t").iterdir() if p.is_dir()]
    spans = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    host = sorted((e for e in spans if e["cat"] == "host"), key=lambda e: e["ts"])
    device = sorted((e for e in spans if e["cat"] == "device"), key=lambda e: e["ts"])
    assert len(host) == len(device) == 2
    assert device[0]["dur"] > 5000  # µs
    # back to back: the second starts where the first ends (to 1 ns, the float rounding of µs times)
    assert device[1]["ts"] >= device[0]["ts"] + device[0]["dur"] - 1e-3
    assert host[1]["ts"] < device[0]["ts"] + device[0]["dur"]  # enqueued while the first was running


def test_a_queue_runs_its_exec_objects_one_after_another_in_paced_time(
    kv: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Two programs on one device, one run each on a single-threaded queue: the queue's worker hands
    over the second only once the first has ended, so its device span starts at the first's modelled
    end, though the two programs could run side by side (on two queues they overlap)."""
    monkeypatch.setenv("QAIC_SIM_PACE_AS", "qwen2.5-0.5b")
    reset_machine()
    ctx = qaicrt.Context()
    programs = [qaicrt.Program(ctx, 0, qaicrt.Qpc(str(kv))) for _ in range(2)]
    for program in programs:
        assert program.load() == QStatus.SUCCESS and program.activate() == QStatus.SUCCESS

    def spans(queues: list[qaicrt.Queue], name: str) -> list[dict]:
        exes = [qaicrt.ExecObj(ctx, program) for program in programs]
        for exe in exes:
            exe.setData(
                [
                    (0, np.ones((2, 1, D), np.float32)),
                    (1, np.array([[0], [0]])),
                    (2, np.array([[0], [1]])),
                    (4, np.zeros((2, D), np.float32)),
                ]
            )
        get_machine().trace.start(tmp_path / name, run_dirs=False)
        for queue, exe in zip(queues, exes, strict=True):
            assert queue.enqueue(exe) == QStatus.SUCCESS
        for exe in exes:
            assert exe.waitForCompletion() == QStatus.SUCCESS
        path = get_machine().trace.stop()
        assert path is not None
        events = json.loads(path.read_text())["traceEvents"]
        return sorted((e for e in events if e["ph"] == "X" and e["cat"] == "device"), key=lambda e: e["ts"])

    one = qaicrt.Queue(ctx, 0)
    serial = spans([one, one], "one-queue")
    assert len(serial) == 2 and serial[0]["dur"] > 5000  # µs
    assert serial[1]["ts"] >= serial[0]["ts"] + serial[0]["dur"] - 1e-3  # to the float rounding of µs
    side = spans([qaicrt.Queue(ctx, 0), qaicrt.Queue(ctx, 0)], "two-queues")
    assert len(side) == 2 and side[1]["ts"] < side[0]["ts"] + side[0]["dur"]
    for program in programs:
        program.unload()
