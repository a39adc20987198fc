"""Topology from env and config file, QAIC_VISIBLE_DEVICES, the plugin, and the qaic-sim CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from sim_programs import compile_program, kv_specs, write_kv_model

from qaic_core.errors import QaicConfigError
from qaic_core.manager import get_plugin_manager
from qaic_core.types import SKUS, SkuType
from qaic_sim import aicapi, qaicrt
from qaic_sim.config import load_config, parse_topology
from qaic_sim.machine import reset_machine


def test_default_is_one_ultra_card() -> None:
    util = qaicrt.Util()
    status, ids = util.getDeviceIds()
    assert status == qaicrt.QStatus.SUCCESS and ids == [0, 1, 2, 3]
    for qid in ids:
        _, info = util.getResourceInfo(qid)
        assert (info.nspTotal, info.nspFree, info.dramTotal, info.skuType) == (16, 16, 32 * 1024, "ultra")
        _, dev = util.getDeviceInfo(qid)
        assert dev.cardId == 0 and dev.socId == qid and dev.pciVendorId == 0x17CB


def test_topology_string_and_sku_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_topology("standard:2,pro") == (SkuType.STANDARD, SkuType.STANDARD, SkuType.PRO)
    monkeypatch.setenv("QAIC_SIM_TOPOLOGY", "standard:2,ai080-ultra")
    topo = reset_machine().topology
    assert [d.sku for d in topo.devices] == [SkuType.STANDARD] * 2 + [SkuType.AI080_ULTRA] * 4
    assert [d.card for d in topo.devices] == [0, 1, 2, 2, 2, 2]
    _, info = qaicrt.Util().getResourceInfo(2)
    assert info.nspTotal == SKUS[SkuType.AI080_ULTRA].nsp_per_soc == 8
    _, info = qaicrt.Util().getResourceInfo(0)
    assert info.dramTotal == 16 * 1024


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("ultra,", "empty entry"),
        ("mega", "unknown card type 'mega'"),
        ("pro:0", "must be >= 1"),
        ("pro:x", "not an integer"),
    ],
)
def test_bad_topology_strings(value: str, message: str) -> None:
    with pytest.raises(QaicConfigError, match=message):
        parse_topology(value)


def test_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "sim.yaml"
    cfg.write_text(
        f"cards: [pro, {{sku: standard, count: 2}}]\ntrace_dir: {tmp_path / 't'}\npace: true\nthreads: 1\n"
    )
    config = load_config({"QAIC_SIM_CONFIG": str(cfg)})
    assert config.cards == (SkuType.PRO, SkuType.STANDARD, SkuType.STANDARD)
    assert config.pace and config.threads == 1 and config.trace_dir == tmp_path / "t"
    overridden = load_config(
        {"QAIC_SIM_CONFIG": str(cfg), "QAIC_SIM_TOPOLOGY": "ultra", "QAIC_SIM_PACE": "0"}
    )
    assert overridden.cards == (SkuType.ULTRA,) and not overridden.pace
    cfg.write_text("cards: [pro]\nspeed: 11\n")
    with pytest.raises(QaicConfigError, match="unknown keys \\['speed'\\]"):
        load_config({"QAIC_SIM_CONFIG": str(cfg)})
    with pytest.raises(QaicConfigError, match="no such file"):
        load_config({"QAIC_SIM_CONFIG": str(tmp_path / "missing.yaml")})


def test_fused_attention_setting(tmp_path: Path) -> None:
    assert load_config({}).fused_attention
    assert not load_config({"QAIC_SIM_FUSED_ATTENTION": "0"}).fused_attention
    cfg = tmp_path / "sim.yaml"
    cfg.write_text("fused_attention: false\n")
    assert not load_config({"QAIC_SIM_CONFIG": str(cfg)}).fused_attention
    assert load_config({"QAIC_SIM_CONFIG": str(cfg), "QAIC_SIM_FUSED_ATTENTION": "1"}).fused_attention
    cfg.write_text("fused_attention: sometimes\n")
    with pytest.raises(QaicConfigError, match="'fused_attention' must be true or false"):
        load_config({"QAIC_SIM_CONFIG": str(cfg)})


def test_visible_devices_filter_and_renumber(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("QAIC_SIM_TOPOLOGY", "standard,pro")
    monkeypatch.setenv("QAIC_VISIBLE_DEVICES", "1")
    topo = reset_machine().topology
    assert qaicrt.Util().getDeviceIds()[1] == [0]
    assert topo.devices[0].sku == SkuType.PRO and topo.devices[0].physical_qid == 1
    onnx_path, _ = write_kv_model(tmp_path / "kv.onnx")
    qpc = compile_program(tmp_path / "p", onnx_path, kv_specs())
    program = qaicrt.Program(qaicrt.Context(qaicrt.QIDList([0])), 0, qaicrt.Qpc(str(qpc)))
    assert program.load() == qaicrt.QStatus.SUCCESS
    assert program.devices[0].physical_qid == 1
    for bad in ("3", "0,0", "a"):
        monkeypatch.setenv("QAIC_VISIBLE_DEVICES", bad)
        with pytest.raises(QaicConfigError, match="QAIC_VISIBLE_DEVICES"):
            reset_machine()
    monkeypatch.delenv("QAIC_VISIBLE_DEVICES")


def test_plugin_registers_sim_backend() -> None:
    pm = get_plugin_manager(strict=True)
    backend = pm.select_device_backend("sim")
    assert backend.package == "qaic-sim" and backend.priority == 10
    assert backend.runtime() is qaicrt and backend.aicapi() is aicapi
    assert {
        "compile",
        "retained_state",
        "faults",
        "traces",
        "timing",
        "slicing",
        "mxint8",
    } <= backend.capabilities


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, **(env or {})}
    for name in ("QAIC_VISIBLE_DEVICES", "QAIC_SIM_CONFIG"):
        full.pop(name, None)
    full.update(env or {})
    full["COLUMNS"] = "200"
    exe = Path(sys.executable).with_name("qaic-sim")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "qaic_sim.cli"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, env=full, timeout=120, check=False)


def test_cli_list() -> None:
    result = _cli("list", env={"QAIC_SIM_TOPOLOGY": "standard,ultra"})
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if "standard" in line or "ultra" in line]
    assert len(rows) == 5 and "16/16" in rows[0] and "16384/16384" in rows[0] and "32768/32768" in rows[1]
    bad = _cli("list", env={"QAIC_VISIBLE_DEVICES": "7"})
    assert bad.returncode == 2 and "device 7 does not exist" in bad.stderr  # errors go to stderr


def test_cli_compile_and_qpc(tmp_path: Path) -> None:
    onnx_path, _ = write_kv_model(tmp_path / "kv.onnx")
    from qaic_core import qpc as layout

    layout.write_specializations(tmp_path / "specializations.json", kv_specs())
    result = _cli(
        "compile", "-aic-hw", f"-m={onnx_path}", "-retained-state", "-aic-num-cores=2",
        f"-network-specialization-config={tmp_path / 'specializations.json'}", f"-aic-binary-dir={tmp_path / 'qpc'}",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    shown = _cli("qpc", str(tmp_path / "qpc"))
    assert shown.returncode == 0, shown.stdout
    assert (
        "past_key.0_RetainedState" in shown.stdout and "Prefill" in shown.stdout and "Decode" in shown.stdout
    )
    bad = _cli("compile", "-aic-hw", f"-m={onnx_path}", "-nonsense")
    assert bad.returncode == 2 and "unknown qaic-compile flag '-nonsense'" in bad.stderr
    assert "-nonsense" not in bad.stdout  # as the real compiler: errors on stderr only


def test_every_simulator_variable_and_fault_kind_is_documented() -> None:
    from qaic_sim import config, faults

    page = Path(__file__).resolve().parents[3] / "docs" / "simulator.md"
    if not page.is_file():
        pytest.skip("docs are not part of this checkout")
    text = page.read_text()
    names = [v for k, v in vars(config).items() if k.startswith("QAIC_SIM_") and isinstance(v, str)]
    assert len(names) == 9
    for name in names:
        assert f"`{name}`" in text, name
    for kind in faults.KINDS:
        assert f"`{kind}`" in text, kind
    for preset in config.PACE_PRESETS:
        assert f"`{preset}`" in text, preset
