"""QPC layout files: both specializations.json forms, custom_io.yaml, mdp partition."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qaic_core import qpc
from qaic_core.errors import QaicConfigError
from qaic_core.types import Specialization

SPECS = [
    Specialization("Prefill", {"batch_size": 1, "seq_len": 128, "ctx_len": 2048, "full_batch_size": 8}),
    Specialization("Decode", {"batch_size": 8, "seq_len": 1, "ctx_len": 2048, "full_batch_size": 8}),
]


def test_current_form_round_trips_with_string_values(tmp_path: Path) -> None:
    path = tmp_path / "specializations.json"
    qpc.write_specializations(path, SPECS)
    raw = json.loads(path.read_text())
    assert raw["specializations"][0] == {
        "name": "Prefill",
        "symbols": {"batch_size": "1", "seq_len": "128", "ctx_len": "2048", "full_batch_size": "8"},
    }
    assert qpc.read_specializations(path) == SPECS


def test_legacy_flat_form_is_read(tmp_path: Path) -> None:
    path = tmp_path / "specializations.json"
    qpc.write_specializations(path, SPECS, legacy=True)
    assert json.loads(path.read_text())["specializations"][1] == {
        "batch_size": "8",
        "seq_len": "1",
        "ctx_len": "2048",
        "full_batch_size": "8",
    }
    read = qpc.read_specializations(path)
    assert [s.symbols for s in read] == [s.symbols for s in SPECS]
    path.write_text(json.dumps([{"batch_size": "1"}]))
    assert qpc.read_specializations(path)[0].symbols == {"batch_size": 1}


def test_bad_specializations_are_rejected(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"specializations": []}))
    with pytest.raises(QaicConfigError, match="non-empty"):
        qpc.read_specializations(path)
    path.write_text(json.dumps({"specializations": [{"seq_len": "x"}]}))
    with pytest.raises(QaicConfigError, match="non-integer"):
        qpc.read_specializations(path)


def test_custom_io_for_mxint8_kv(tmp_path: Path) -> None:
    path = tmp_path / "custom_io.yaml"
    qpc.write_custom_io(path, qpc.kv_custom_io(2, "mxint8"))
    text = path.read_text()
    assert "IOName: past_key.0\n  Precision: mxint8" in text
    read = qpc.read_custom_io(path)
    assert len(read) == 8 and read["past_value.1_RetainedState"] == "mxint8"


def test_qpc_exists_and_hash(tmp_path: Path) -> None:
    assert not qpc.qpc_exists(tmp_path)
    (tmp_path / "qpc").mkdir()
    (tmp_path / "qpc" / "programqpc.bin").write_bytes(b"x")
    assert qpc.qpc_exists(tmp_path) and qpc.qpc_exists(tmp_path / "qpc")
    assert qpc.params_hash({"a": 1, "b": 2}) == qpc.params_hash({"b": 2, "a": 1})
    assert qpc.params_hash({"a": 1}) != qpc.params_hash({"a": 2})


def test_mdp_partition_for_four_devices() -> None:
    mdp = qpc.mdp_partition([0, 1, 2, 3], 16)
    assert mdp["connections"] == [{"devices": [0, 1, 2, 3], "type": "p2p"}]
    assert mdp["partitions"][0]["devices"][3] == {"deviceId": 3, "numCores": 16}
