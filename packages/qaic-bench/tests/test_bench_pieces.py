"""Small pieces of the benchmarks: settings parity with the engine, device clock, environment, machine."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from qaic_bench import methods
from qaic_bench.child import run_in_child
from qaic_bench.host import PHASES, DeviceClock, breakdown, observing
from qaic_bench.machine import MATMUL_ISA, git_commit, machine_info, matmul_isa
from qaic_bench.report import TIMING_ROW_KEYS
from qaic_bench.run import bench_env
from qaic_bench.server import ServeShape, VllmServer, free_port
from qaic_bench.settings import BenchSettings
from qaic_bench.stack import compile_settings, qpc_dirs, random_prompts
from qaic_bench.startup import qpc_ready_seconds
from qaic_bench.timers import PhaseTimers
from qaic_bench.timing_model import timing_model_rows
from qaic_core import get_plugin_manager
from qaic_core.observe import StepRecord


def _vllm_config(shape: ServeShape, dtype: str) -> SimpleNamespace:
    """The attributes of a VllmConfig that ``engine_settings`` reads."""
    return SimpleNamespace(
        additional_config=shape.additional_config() or {},
        model_config=SimpleNamespace(max_model_len=shape.max_model_len, dtype=dtype, quantization=None),
        scheduler_config=SimpleNamespace(
            max_num_seqs=shape.max_num_seqs, long_prefill_token_threshold=shape.prefill_seq_len
        ),
        cache_config=SimpleNamespace(cache_dtype="auto"),
        speculative_config=None,  # a VllmConfig always has it (None without --speculative-config)
    )


@pytest.mark.parametrize(
    "shape",
    [
        ServeShape(8, 256, 128),
        ServeShape(1, 256, 64),
        ServeShape(32, 128, 256),
        ServeShape(16, 256, 128, comp_ctx_lengths=(64, 128, 256)),
    ],
)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_raw_loop_compiles_what_the_engine_compiles(
    shape: ServeShape, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from qaic_vllm.config import engine_settings
    from qaic_vllm.envs import ENV_VARS

    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    engine = engine_settings(_vllm_config(shape, dtype))  # type: ignore[arg-type]
    assert compile_settings(shape, dtype) == engine.compile


def test_device_clock_tells_full_decode_steps_from_prefill() -> None:
    clock = DeviceClock()
    clock.run_submitted({"input_ids": np.zeros((4, 1), np.int64)}, 0, 0.25)
    clock.run_waited(0, 0.5)
    clock.phase("runner", 1.0)
    clock.step(StepRecord(decode_rows=4, prefill_tokens=0, running=4))
    assert clock.seconds == 0.75 and clock.phases.seconds == {"runner": 1.0}
    assert clock.full_decode(4) and not clock.full_decode(8)
    clock.reset()
    assert (clock.seconds, clock.steps, dict(clock.phases.seconds)) == (0.0, [], {})
    assert not clock.full_decode(4)  # no step ran
    clock.step(StepRecord(decode_rows=3, prefill_tokens=16, running=4))
    assert not clock.full_decode(3)  # a prefill chunk ran beside the decode


def test_observing_registers_the_observer_only_inside_the_block() -> None:
    clock = DeviceClock()
    pm = get_plugin_manager()
    assert clock not in pm.observers().observers
    with observing(clock) as plugin:
        assert pm.is_registered(plugin)
        assert clock in pm.observers().observers
        pm.observers().phase("schedule", 0.5)
    assert not pm.is_registered(plugin)
    assert clock not in pm.observers().observers
    assert clock.phases.seconds == {"schedule": 0.5}


def test_random_prompts_have_the_lengths_asked_and_no_special_ids() -> None:
    prompts = random_prompts([3, 64, 17], vocab_size=300, seed=4)
    assert [len(p) for p in prompts] == [3, 64, 17]
    assert all(16 <= t < 300 for p in prompts for t in p)
    assert prompts == random_prompts([3, 64, 17], vocab_size=300, seed=4)


def test_qpc_dirs_finds_compiled_programs(tmp_path: Path) -> None:
    program = tmp_path / "LlamaForCausalLM" / "m-1" / "qpc-abc" / "qpc" / "programqpc.bin"
    program.parent.mkdir(parents=True)
    program.write_bytes(b"x")
    (tmp_path / "LlamaForCausalLM" / "m-1" / "qpc-half" / "qpc").mkdir(parents=True)
    assert qpc_dirs(tmp_path) == {tmp_path / "LlamaForCausalLM" / "m-1" / "qpc-abc"}


def test_bench_env_sets_backend_home_and_pacing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QAIC_SIM_PACE", "1")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    plain = bench_env(tmp_path, "ultra")
    assert plain["QAIC_BACKEND"] == "sim" and plain["QEFF_HOME"] == str(tmp_path)
    assert "QAIC_SIM_PACE" not in plain and "VLLM_ENABLE_V1_MULTIPROCESSING" not in plain
    paced = bench_env(tmp_path, "ultra", "Llama-2-7B")
    assert (paced["QAIC_SIM_PACE"], paced["QAIC_SIM_PACE_AS"]) == ("1", "Llama-2-7B")


def test_serve_shape_flags_and_settings() -> None:
    assert ServeShape(8, 256, 128).args() == [
        "--max-num-seqs",
        "8",
        "--max-model-len",
        "256",
        "--long-prefill-token-threshold",
        "128",
    ]
    for s in (BenchSettings.quick(), BenchSettings.full()):
        assert s.host_batches == (1, 8, 32)
        assert s.input_len + s.output_len <= s.max_model_len
        assert s.host_input_len + s.host_output_len <= s.max_model_len
        assert s.num_prompts % s.batch == 0
    assert 1024 <= free_port() < 65536


def test_methods_describe_every_part_even_without_results() -> None:
    text = methods.describe(BenchSettings.quick(), "float16", "qaic-tiny-llama", {})
    from qaic_bench.report import REPORT_KEYS

    assert set(text) == set(REPORT_KEYS) - {"machine", "commit"}  # every measured part
    assert "QAIC_SIM_PACE_AS=" in text["stack_overhead"]
    assert "compute-context lengths 64, 128, 256:" in text["vs_vllm_cpu"]  # what part 11 serves qaic with
    assert "16 x batch prompts per run) alternating between the two for 5 rounds" in text["vs_vllm_cpu"]


def test_machine_and_commit() -> None:
    info = machine_info()
    assert set(info) == {"cpu", "matmul_isa", "cores", "memory", "python", "torch", "vllm"}
    assert info["matmul_isa"]  # the features found, "none of ..." or "unknown": never empty
    assert info["matmul_isa"] == matmul_isa()  # read from this machine's /proc/cpuinfo
    assert isinstance(info["cores"], int) and info["cores"] >= 1
    sha, dirty = git_commit()
    assert sha == "unknown" or re.fullmatch(r"[0-9a-f]{40}", sha)
    assert isinstance(dirty, bool)


def test_matmul_isa_reads_the_flags_line() -> None:
    amx = "processor\t: 0\nmodel name\t: Xeon\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_tile amx_bf16 amx_int8\n"
    assert matmul_isa(amx) == "avx2 avx512f avx512_bf16 amx_bf16 amx_int8"
    assert matmul_isa("flags\t: fpu sse sse2\n") == "none of " + ", ".join(MATMUL_ISA)
    assert matmul_isa("processor\t: 0\n") == "unknown"  # no flags line (not x86 Linux)


@pytest.mark.parametrize("flag", ["--rounds", "--prompts-per-batch"])
@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_vllm_cpu_refuses_counts_below_one(
    flag: str, value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from qaic_bench import vllm_cpu

    with pytest.raises(SystemExit) as exc:  # argparse's usage error, before any server starts
        vllm_cpu.main(["--out", str(tmp_path), flag, value])
    assert exc.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err
    assert not (tmp_path / "work").exists()


def test_phase_timers_sum_reports_and_name_missing_phases() -> None:
    timers = PhaseTimers()
    timers.add("schedule", 0.25)
    timers.add("schedule", 0.5)
    timers.add("sampling", 0.125)
    assert timers.seconds == {"schedule": 0.75, "sampling": 0.125}
    timers.reset()
    assert timers.seconds == {}
    assert timers.missing(PHASES) == ["runner"]  # reported phases stay known after a reset


def test_timing_model_rows_come_from_the_qaic_sim_command() -> None:
    rows = timing_model_rows()
    assert len(rows) >= 10
    assert all(set(row) == set(TIMING_ROW_KEYS) for row in rows)
    assert {"Ultra", "Standard"} <= {row["card"] for row in rows}


def test_breakdown_splits_host_time() -> None:
    # wall 10 ms: device 6, scheduling 1, runner call 8.5 of which sampling 1.5 -> inputs 1, rest 1
    parts = breakdown(0.010, 0.006, {"schedule": 0.001, "runner": 0.0085, "sampling": 0.0015})
    expected = {
        "host": 0.004,
        "schedule": 0.001,
        "runner_inputs": 0.001,
        "sampling": 0.0015,
        "engine_other": 0.0005,
    }
    assert parts == pytest.approx(expected)


def test_host_breakdown_table() -> None:
    results = {
        "host_8": {"batch": 8, "host_us": 900.0, "device_us": 5000.0, "steps": 20, "missing_phases": [],
                   "phases_us": {"schedule": 100.0, "runner_inputs": 300.0, "sampling": 200.0, "engine_other": 300.0}},
        "host_1": {"batch": 1, "host_us": 700.0, "device_us": 4000.0, "steps": 21, "missing_phases": ["a.B"],
                   "phases_us": {"schedule": 100.0, "runner_inputs": 200.0, "sampling": 100.0, "engine_other": 300.0}},
    }  # fmt: skip
    table = methods.host_breakdown(results)
    lines = [line for line in table.splitlines() if line.startswith("| ")]
    assert lines[1] == "| 1 | 700 | 100 | 200 | 100 | 300 | 4000 | 21 |"
    assert lines[2] == "| 8 | 900 | 100 | 300 | 200 | 300 | 5000 | 20 |"
    assert "Not found, so not split out: a.B." in table


def test_child_failure_names_the_job_and_shows_its_log(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"the nonsense measurement failed \(exit 1\)") as info:
        run_in_child("nonsense", {}, dict(os.environ), tmp_path)
    assert "unknown job kind 'nonsense'" in str(info.value)


def test_qpc_ready_seconds_reads_the_worker_log(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text("(qaic) INFO 12-02 16:32:07 [qaic.vllm.worker] qaic: QPC ready in 0.7s: /x/qpc\nmore\n")
    assert qpc_ready_seconds(log) == 0.7
    log.write_text("nothing here\n")
    assert qpc_ready_seconds(log) is None
    assert qpc_ready_seconds(tmp_path / "absent.log") is None
    note = methods.describe(BenchSettings.full(), "float16", "m", {"qpc_first_s": 12.5, "qpc_cached_s": 0.1})
    assert (
        "12.5 s for export + compile" in note["startup_s"]
        and "0.1 s for the cache lookup" in note["startup_s"]
    )


def test_padding_waste_is_computed_over_needed_tokens() -> None:
    from qaic_bench.load import StepTotals

    totals = StepTotals()
    totals.step(StepRecord(0, 40, 1, prefill_computed=64, prefill_runs=1))
    totals.step(StepRecord(2, 10, 3, decode_tokens=2, decode_computed=8, prefill_computed=16, prefill_runs=1))
    totals.step(StepRecord(4, 0, 4, decode_tokens=4, decode_computed=8))
    assert totals.waste() == {"prefill": 1.6, "decode": 2.667}
    assert StepTotals().waste() == {"prefill": None, "decode": None}


def test_vllm_cpu_environment_reads_the_wheels_pins(tmp_path: Path) -> None:
    import zipfile

    from qaic_bench.vllm_cpu import LEFT_OUT, cpu_env, torch_pin, wheel_requirements

    wheel = tmp_path / "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(
            "vllm_cpu-0.32.0.dist-info/METADATA",
            "Name: vllm-cpu\nVersion: 0.32.0\nRequires-Dist: regex\n"
            'Requires-Dist: torch==2.13.0+cpu; platform_machine == "x86_64"\n'
            'Requires-Dist: torch==2.13.0; platform_system == "Darwin"\n'
            'Requires-Dist: torchaudio; platform_machine != "s390x"\n'
            'Requires-Dist: pandas; extra == "bench"\n',
        )
    reqs = wheel_requirements(wheel)
    assert "regex" in reqs and not any("pandas" in r for r in reqs)
    assert torch_pin(reqs) == "torch==2.13.0+cpu"
    assert "torchaudio" in LEFT_OUT
    env = cpu_env({"QAIC_BACKEND": "sim", "VLLM_PLUGINS": "qaic", "PATH": "/bin", "QEFF_HOME": "/q"})
    assert env["PATH"] == "/bin" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert not {"QAIC_BACKEND", "VLLM_PLUGINS", "QEFF_HOME"} & set(env)


def test_parts_are_chosen_by_their_numbers() -> None:
    from qaic_bench.__main__ import part_keys

    assert part_keys(None) is None
    # Part 2 measures the host work the device waits for too (its companion key).
    assert part_keys("2, 10,11") == {
        "host_overhead_us",
        "host_on_device_path_us",
        "device_load",
        "vs_vllm_cpu",
    }
    assert part_keys("10") == {"device_load"}
    with pytest.raises(ValueError, match="no part '12'"):
        part_keys("1,12")


def test_decode_waits_are_the_device_gaps_between_decode_runs(tmp_path: Path) -> None:
    from qaic_bench.load import decode_waits
    from qaic_sim.trace import RunRecord, TraceRecorder

    recorder = TraceRecorder(tmp_path, run_dirs=False)
    t0 = recorder.origin

    def run(name: str, enqueued: float, device_start: float, end: float) -> None:
        recorder.record(
            RunRecord(
                program="p", specialization=name, spec_index=0, qids=[0], status=0,
                start_s=t0 + enqueued, wall_s=end - enqueued, device_time_s=end - device_start,
                queue=1, exec_obj=1, device_start_s=t0 + device_start,
            )
        )  # fmt: skip

    run("Decode", 0.000, 0.000, 0.010)
    run("Decode", 0.0105, 0.0105, 0.020)  # 500 µs after the first ended
    run("Decode", 0.019, 0.020, 0.030)  # enqueued before the device was free: no wait
    run("Prefill", 0.031, 0.031, 0.040)  # a prefill between two decodes: not a decode gap
    run("Decode", 0.041, 0.041, 0.050)
    waits = decode_waits(recorder.close())
    assert waits == pytest.approx([500.0, 0.0], abs=1e-3)
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]


def test_the_stacks_own_work_runs_from_a_decodes_wait_to_the_next_decodes_hand_over() -> None:
    from qaic_bench.load import DecodeHandOvers

    clock = iter([0.0, 1.0, 1.0002, 2.0, 2.0001, 2.5, 3.0, 3.0003])
    seen = DecodeHandOvers(clock=lambda: next(clock))
    decode = {"input_ids": np.zeros((4, 1), np.int64)}
    prefill = {"input_ids": np.zeros((1, 32), np.int64)}
    seen.run_submitted(decode, 0, 0.0)  # 0.0
    seen.run_waited(0, 1.0)  # 1.0: the decode is waited for
    seen.run_submitted(decode, 0, 0.0)  # 1.0002: the next decode, 200 µs later
    seen.run_waited(0, 1.0)  # 2.0
    seen.run_submitted(prefill, 1, 0.0)  # 2.0001: a prefill comes between: no pair
    seen.run_submitted(decode, 0, 0.0)  # 2.5
    seen.run_waited(1, 0.5)  # 3.0: the prefill's wait is not a decode's
    seen.run_submitted(decode, 0, 0.0)  # 3.0003
    assert seen.own_us() == pytest.approx([200.0], abs=1e-3)


def test_a_part_left_out_by_parts_leaves_its_companion_out_too(tmp_path: Path) -> None:
    from qaic_bench.run import Runner

    runner = Runner(BenchSettings.quick(), tmp_path, tmp_path / "model", parts=frozenset({"machine"}))
    report = runner.run()
    for key in ("host_overhead_us", "host_on_device_path_us", "stack_overhead", "device_load"):
        assert report.errors[key] == "not run: not among --parts", key


def test_the_on_path_method_names_each_batchs_p90_beside_part_2s_own_rows() -> None:
    host = {"batch": 8, "steps": 60, "device_us": 9000.0, "host_us": 1300.0}
    wait = {"median": 391.0, "p90": 495.0, "count": 62}
    results = {
        "host_8": host,
        "on_path": {"32": {"decode_wait_us": {**wait, "p90": 743.0}}, "8": {"decode_wait_us": wait}},
    }
    text = methods.describe(BenchSettings.full(), "float32", "m", results)
    assert "batch 8: p90 495.0 µs over 62 waits, batch 32: p90 743.0 µs" in text["host_on_device_path_us"]
    assert "batch 8: 60 steps" in text["host_overhead_us"]


def _stat(pid: int) -> list[str]:
    """/proc/PID/stat after the command name: [0] the state letter (``T`` stopped), [11] user ticks."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def test_a_paused_server_takes_no_processor_time_and_still_stops(tmp_path: Path) -> None:
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
    server = VllmServer(Path("unused"), ServeShape(1, 64, 64), {}, tmp_path / "log", proc=busy)
    try:
        server.pause()
        time.sleep(0.2)
        assert _stat(busy.pid)[0] == "T"
        before = _stat(busy.pid)[11]
        time.sleep(0.5)
        assert _stat(busy.pid)[11] == before, "a paused server was scheduled"
        server.resume()
        time.sleep(0.5)
        assert _stat(busy.pid)[0] != "T"
        assert int(_stat(busy.pid)[11]) > int(before), "a resumed server did not run"
        server.pause()
    finally:
        server.stop()  # resumes the group first, so that its SIGINT is delivered
    assert busy.poll() is not None
