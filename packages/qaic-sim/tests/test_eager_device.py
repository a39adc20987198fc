"""The simulator's eager device layer: DDR accounting, modelled step time, traces, pacing and faults."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from eager_devices import CONFIG, MB, open_device

from qaic_core.eager import DeviceMemoryError, EagerDevice, EagerStep
from qaic_core.errors import QaicConfigError, QaicRuntimeError
from qaic_core.manager import get_plugin_manager
from qaic_sim import qaicrt
from qaic_sim.machine import get_machine, reset_machine
from qaic_sim.timing import HardwareModel, device_time_s
from qaic_sim.timing_cost import ProgramCost
from qaic_sim.timing_eager import eager_step_cost


def test_the_sim_backend_offers_an_eager_device_on_the_first_visible_qid() -> None:
    device = open_device()
    assert isinstance(device, EagerDevice)
    assert device.torch_device == "cpu"
    assert device.device_ids == (0,)
    assert device.name == "QID 0 (simulated ultra)"
    assert device.total_bytes() == 32 * 1024 * MB


def test_reservations_are_taken_from_the_qids_ddr_and_given_back() -> None:
    device = open_device(device_group=(1,))
    qid1 = get_machine().topology.device(1)
    assert qid1 is not None
    free = qid1.dram_free
    device.reserve("weights", 100 * MB)
    device.reserve("kv cache", 50 * MB)
    assert qid1.dram_free == free - 150 * MB
    assert device.free_bytes() == free - 150 * MB
    device.release("kv cache")
    assert qid1.dram_free == free - 100 * MB
    device.close()
    assert qid1.dram_free == free


def test_a_reservation_that_does_not_fit_names_the_device_and_the_numbers() -> None:
    device = open_device()
    device.reserve("weights", 30 * 1024 * MB)
    with pytest.raises(
        DeviceMemoryError, match=r"QID 0 \(simulated ultra\) for the kv cache: it needs 4096.0 MB"
    ):
        device.reserve("kv cache", 4 * 1024 * MB)
    device.close()


def test_programs_and_eager_models_share_the_qids_ddr() -> None:
    device = open_device()
    dev = get_machine().topology.device(0)
    assert dev is not None
    dev.dram_used += 31 * 1024 * MB  # as a loaded program would hold it
    with pytest.raises(QaicConfigError, match="not enough device memory"):
        device.reserve("weights", 2 * 1024 * MB)


def test_a_dropped_device_layer_gives_its_memory_back() -> None:
    dev = get_machine().topology.device(0)
    assert dev is not None
    free = dev.dram_free
    device = open_device()
    device.reserve("weights", 10 * MB)
    del device
    assert dev.dram_free == free


def test_a_device_group_of_several_socs_or_an_invisible_qid_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(QaicConfigError, match="one SoC"):
        open_device(device_group=(0, 1))
    monkeypatch.setenv("QAIC_VISIBLE_DEVICES", "2")
    reset_machine()
    with pytest.raises(QaicConfigError, match=r"device 1 is not visible: the visible devices are \[0\]"):
        open_device(device_group=(1,))
    assert open_device().device_ids == (0,)


def test_a_step_counts_as_a_run_with_the_modelled_device_time() -> None:
    device = open_device()
    work = EagerStep(query_lens=[16, 1, 1], seq_lens=[16, 40, 7], num_logits=3)
    with device.step(work):
        pass
    expected = device_time_s(
        eager_step_cost(
            CONFIG, [16, 1, 1], [16, 40, 7], 3, weight_precision="float32", kv_precision="float32"
        ),
        HardwareModel.for_device_group("ultra", 1, None),
    )
    status, info = qaicrt.Util().getPerformanceInfo(0)
    assert status == qaicrt.QStatus.SUCCESS and info is not None
    assert info.numRuns == 1
    assert info.deviceTimeS == pytest.approx(expected)
    assert expected > 0


def test_step_cost_reads_each_sequences_own_context() -> None:
    decode = eager_step_cost(CONFIG, [1, 1], [100, 10], 2)
    same_as_aot = ProgramCost.for_decoder(CONFIG, batch=2, seq_len=1, ctx_len=100)
    assert decode.kv_read_bytes == pytest.approx(same_as_aot.kv_read_bytes * 110 / 200)
    assert decode.weight_bytes == pytest.approx(same_as_aot.weight_bytes)
    assert decode.flops < same_as_aot.flops


def test_steps_are_traced_like_runs(tmp_path: Path) -> None:
    device = open_device()
    control = get_plugin_manager().select_device_backend("sim").trace
    assert control is not None
    control.start(tmp_path)
    with device.step(EagerStep(query_lens=[5], seq_lens=[5], num_logits=1)):
        pass
    control.stop()
    summary = json.loads((tmp_path / "lrt_trace_1" / "summary.json").read_text())
    assert summary["specialization"] == "eager"
    assert summary["program"] == "tiny"
    assert summary["extra"] == {"tokens": 5, "sequences": 1, "logits": 1, "context_tokens": 5}
    assert summary["device_time_s"] > 0
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert any(e.get("name") == "device eager" for e in events)


def test_pacing_makes_a_step_last_its_device_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QAIC_SIM_PACE_AS", "llama-2-7b")
    reset_machine()
    device = open_device()
    work = EagerStep(query_lens=[1], seq_lens=[64], num_logits=1)
    modelled = device.device_time_s(work)  # type: ignore[attr-defined]
    assert modelled > 0.01  # a 7B model's decode step, not the tiny model's
    start = time.perf_counter()
    with device.step(work):
        pass
    assert time.perf_counter() - start >= modelled


def test_an_injected_fault_fails_the_step() -> None:
    device = open_device()
    faults = get_plugin_manager().select_device_backend("sim").faults
    assert faults is not None
    faults.inject("dev_error", qid=0, at=2)
    work = EagerStep(query_lens=[1], seq_lens=[1], num_logits=1)
    with device.step(work):
        pass
    with pytest.raises(QaicRuntimeError, match="injected fault on QID 0"), device.step(work):
        pass


def test_settling_an_estimate_holds_exactly_what_was_allocated() -> None:
    device = open_device()
    dev = get_machine().topology.device(0)
    assert dev is not None
    free = dev.dram_free
    device.reserve("weights", 10 * MB)
    device.settle("weights", 12 * MB)
    assert dev.dram_free == free - 12 * MB
    device.settle("weights", 9 * MB)
    assert dev.dram_free == free - 9 * MB
    with pytest.raises(DeviceMemoryError, match="for the weights"):
        device.settle("weights", 40 * 1024 * MB)
    device.close()
    assert dev.dram_free == free
