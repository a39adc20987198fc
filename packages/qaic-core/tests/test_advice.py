"""The fix a refused runtime call carries, and vllm-qaic's spellings of compile settings."""

from __future__ import annotations

import pytest

from qaic_core.advice import ProgramNeeds, status_advice
from qaic_core.errors import QaicConfigError
from qaic_core.resources import MB, DeviceResources
from qaic_core.settings import CompileSettings, parse_arguments, parse_device_ids
from qaic_core.types import QStatus

AI080 = DeviceResources(
    qid=2, nsp_total=8, nsp_free=8, dram_total_mb=32768, dram_free_mb=32768, sku="ai080-ultra"
)


def test_too_few_cores_names_the_setting_and_the_value() -> None:
    text = status_advice(QStatus.NOSPC, "Program.activate", ProgramNeeds(num_cores=16), [AI080])
    assert "compiled for 16 NSP cores but QID 2 has 8 of 8 NSP cores free" in text
    assert '"num_cores": 8' in text and "VLLM_QAIC_NUM_CORES=8" in text and "--num-cores 8" in text
    busy = DeviceResources(0, 16, 0, 16384, 100)
    assert "stop the programs on QID 0" in status_advice(
        QStatus.NOSPC, "Program.activate", ProgramNeeds(4), [busy]
    )
    assert "VLLM_QAIC_NUM_CORES=N" in status_advice(
        QStatus.NOSPC, "Program.activate"
    )  # nothing known: still the fix


def test_too_little_memory_names_the_shape_settings() -> None:
    needs = ProgramNeeds(dram_bytes_per_device=40000 * MB, smaller="--max-num-seqs 3 at --max-model-len 4096")
    text = status_advice(QStatus.NOMEM, "Program.load", needs, [AI080])
    assert "needs 40000 MB on each device but QID 2 has 32768 of 32768 MB free" in text
    assert "--max-num-seqs" in text and "--kv-cache-dtype mxint8" in text and "device_group" in text
    assert "--max-num-seqs 3 at --max-model-len 4096 would fit" in text
    assert "--max-model-len" in status_advice(QStatus.NOMEM, "Program.load")


@pytest.mark.parametrize(
    ("status", "needle"),
    [(QStatus.BUSY, "another process"), (QStatus.NODEV, "visible ids"), (QStatus.DEV_ERROR, "qaic-util -s")],
)
def test_other_statuses(status: QStatus, needle: str) -> None:
    assert needle in status_advice(status, "Program.load")
    assert status_advice(QStatus.PROTOCOL, "Program.load") == ""


def test_vendor_spellings_of_settings() -> None:
    pieces = "aic_pmu_recipe=KernelUtil|stats_batchsize=1 -v aic_perf_metrics=false|aic_perf_warnings=1|enable_debug"
    assert parse_arguments(pieces, "x") == (
        "-aic-pmu-recipe=KernelUtil",
        "-stats-batchsize=1",
        "-v",
        "-aic-perf-warnings",
        "-enable-debug",
    )
    assert parse_arguments("-a '-b c'", "x") == ("-a", "-b c")
    assert parse_device_ids("[0, 1]", "x") == parse_device_ids("0,1", "x") == (0, 1)
    assert parse_device_ids(3, "x") == (3,)
    s = CompileSettings.from_mapping(
        {"mos": -1, "mxfp6_en": "true", "mxint8_en": 1, "device_ids": "0,1", "num_devices": 2}
    )
    assert (s.mos, s.mxfp6, s.mxint8, s.device_group) == (None, True, True, (0, 1))
    with pytest.raises(QaicConfigError, match="mos"):
        CompileSettings.from_mapping({"mos": 0})
