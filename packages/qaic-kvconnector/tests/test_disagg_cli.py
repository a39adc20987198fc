"""qaic-disagg's command line: vllm-qaic's flag names, per-stage flags and the commands it builds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qaic_core.errors import QaicConfigError
from qaic_kvconnector import disagg


def test_device_groups_ports_and_overrides() -> None:
    assert disagg.parse_device_group("0..3") == [0, 1, 2, 3]
    assert disagg.parse_device_group("4,5") == [4, 5]
    assert disagg.parse_device_group("7") == [7]
    with pytest.raises(QaicConfigError, match=r"0\.\.15"):
        disagg.parse_device_group("3..1")
    assert disagg.parse_ports("9900", 3, 1) == [9900, 9901, 9902]
    assert disagg.parse_ports("9900,9950", 2, 1) == [9900, 9950]
    assert disagg.parse_ports(None, 2, 9800) == [9800, 9801]
    with pytest.raises(QaicConfigError, match="one per instance"):
        disagg.parse_ports("1,2", 3, 1)
    assert disagg.parse_qaic_overrides("mxfp6_matmul:True num_cores:8 dfs:false") == {
        "mxfp6_matmul": True,
        "num_cores": 8,
        "dfs": False,
    }
    assert disagg.parse_qaic_overrides('{"num_cores": 4}') == {"num_cores": 4}


def test_stage_flags_split_by_prefix() -> None:
    extra = [
        "--prefill-max-num-seqs", "1",
        "--decode-max-num-seqs=4",
        "--max-model-len", "512",
        "--decode-speculative-config", '{"method": "ngram"}',
        "--seed", "-1",
    ]  # fmt: skip
    split = disagg.split_stage_args(extra)
    assert split["prefill"] == ["--max-num-seqs", "1", "--max-model-len", "512", "--seed", "-1"]
    assert split["decode"] == [
        "--max-num-seqs=4", "--max-model-len", "512", "--speculative-config", '{"method": "ngram"}', "--seed", "-1",
    ]  # fmt: skip


def test_commands_for_two_prefill_one_decode(tmp_path: Path) -> None:
    argv = [
        "--model", "/m", "--port", "8000",
        "--prefill-device-group", "0", "1",
        "--decode-device-group", "2..3",
        "--prefill-port", "9900", "--decode-port", "9800", "--kv-port", "15000",
        "--kv-transport", "tcp", "--on-transfer-failure", "fail",
        "--prefill-override-qaic-config", "num_cores:8",
        "--kv-cache-dtype", "mxint8", "--log-dir", str(tmp_path),
    ]  # fmt: skip
    ns, extra = disagg.parser().parse_known_args(argv)
    stages = disagg.build_stages(ns, extra)
    assert [(s.name, s.devices, s.port, s.kv_port) for s in stages] == [
        ("prefill-0", [0], 9900, 15000),
        ("prefill-1", [1], 9901, 15001),
        ("decode-0", [2, 3], 9800, 15002),
    ]

    def flag(stage: disagg.Stage, name: str) -> str:
        return stage.args[stage.args.index(name) + 1]

    p0, d0 = stages[0], stages[2]
    kv = json.loads(flag(p0, "--kv-transfer-config"))
    assert kv["kv_connector"] == "QaicConnector" and kv["kv_role"] == "kv_producer"
    assert kv["kv_connector_extra_config"]["transport"] == "tcp"
    assert json.loads(flag(d0, "--kv-transfer-config"))["kv_load_failure_policy"] == "fail"
    assert json.loads(flag(p0, "--additional-config"))["override_qaic_config"] == {
        "num_cores": 8,
        "device_group": [0],
    }
    assert json.loads(flag(d0, "--additional-config"))["override_qaic_config"] == {"device_group": [2, 3]}
    assert flag(d0, "--kv-cache-dtype") == "mxint8" and p0.args[0] == "/m"
    disagg.write_state(stages, tmp_path / "instances.json")
    assert [i["name"] for i in json.loads((tmp_path / "instances.json").read_text())] == [
        s.name for s in stages
    ]


def test_overlapping_groups_and_missing_flags_are_refused(tmp_path: Path) -> None:
    ns, extra = disagg.parser().parse_known_args(
        [
            "--model",
            "m",
            "--prefill-device-group",
            "0..1",
            "--decode-device-group",
            "1",
            "--log-dir",
            str(tmp_path),
        ]
    )
    with pytest.raises(QaicConfigError, match="device 1 is in the groups of both prefill-0 and decode-0"):
        disagg.build_stages(ns, extra)
    ns, extra = disagg.parser().parse_known_args(["--model", "m", "--prefill-device-group", "0"])
    with pytest.raises(QaicConfigError, match="decode-device-group"):
        disagg.build_stages(ns, extra)
    assert disagg.main(["--prefill-device-group", "0", "--decode-device-group", "1"]) == 2


def test_colocated_instances_and_the_link_scale(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "m"
    model.mkdir()
    config = {
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
    }  # fmt: skip
    (model / "config.json").write_text(json.dumps(config))
    argv = ["--model", str(model), "--decode-device-group", "0", "1", "--log-dir", str(tmp_path)]
    stages = disagg.build_stages(*disagg.parser().parse_known_args(argv))
    assert [s.name for s in stages] == ["decode-0", "decode-1"]
    assert all("--kv-transfer-config" not in s.args for s in stages)
    monkeypatch.delenv("QAIC_SIM_PACE_AS", raising=False)
    assert disagg.link_scale("auto", str(model)) == 1.0
    assert disagg.link_scale("2.5", str(model)) == 2.5
    monkeypatch.setenv("QAIC_SIM_PACE_AS", "qwen2.5-0.5b")  # 24 layers x 2 KV heads x 64 vs 2 x 2 x 16
    assert disagg.link_scale("auto", str(model)) == 48.0
