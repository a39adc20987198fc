"""The export/compile cache: real layout, reuse on equal keys, new entries on changed keys, locking."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from qaic_aot import compile as aot_compile
from qaic_aot import compile_model
from qaic_core import qpc as layout
from qaic_core.errors import QaicConfigError, QaicError
from qaic_core.settings import CompileSettings

SETTINGS = CompileSettings(prefill_seq_len=8, ctx_len=64, full_batch_size=2, num_cores=1)


class Calls:
    """Counts exporter and compiler invocations while still running the real ones."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.exports = 0
        self.compiles = 0
        real_export, real_compile = aot_compile.run_export, aot_compile.run_compiler

        def export(*args: Any, **kwargs: Any) -> Any:
            self.exports += 1
            return real_export(*args, **kwargs)

        def compile_(*args: Any, **kwargs: Any) -> None:
            self.compiles += 1
            real_compile(*args, **kwargs)

        monkeypatch.setattr(aot_compile, "run_export", export)
        monkeypatch.setattr(aot_compile, "run_compiler", compile_)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Calls:
    return Calls(monkeypatch)


def _mtimes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


def test_layout_and_reuse(tiny_llama: Path, tmp_path: Path, calls: Calls) -> None:
    home = tmp_path / "home"
    qpc = compile_model(tiny_llama, SETTINGS, qeff_home=home, progress=False)
    export_root = qpc.parent
    assert qpc.name.startswith("qpc-")
    assert export_root.parent == home / "LlamaForCausalLM"
    assert export_root.name.startswith(f"{tiny_llama.name}-")
    assert (export_root / f"{tiny_llama.name}.onnx").is_file()
    assert (export_root / layout.EXPORT_PARAMS_FILE).is_file()
    for name in (
        layout.SPECIALIZATIONS_FILE,
        layout.CUSTOM_IO_FILE,
        layout.COMPILE_PARAMS_FILE,
        layout.QCONFIG_FILE,
    ):
        assert (qpc / name).is_file(), name
    assert layout.qpc_exists(qpc)
    # Only finished entries and their lock files are left: no temporary build folders.
    assert sorted(p.name for p in export_root.iterdir() if p.name.startswith(".")) == []
    qconfig = layout.read_json(qpc / layout.QCONFIG_FILE)
    command = qconfig["qpc_config"]["compiler_command"]
    assert f"-aic-binary-dir={qpc / 'qpc'}" in command and "-retained-state" in command
    assert (calls.exports, calls.compiles) == (1, 1)

    before = _mtimes(home)
    assert compile_model(tiny_llama, SETTINGS, qeff_home=home, progress=False) == qpc
    assert (calls.exports, calls.compiles) == (1, 1)
    assert _mtimes(home) == before


def test_changed_parameters_make_new_entries(tiny_llama: Path, tmp_path: Path, calls: Calls) -> None:
    home = tmp_path / "home"
    base = compile_model(tiny_llama, SETTINGS, qeff_home=home, progress=False)
    # A compile-only change: same ONNX, new program.
    more_cores = compile_model(tiny_llama, SETTINGS.replace(num_cores=2), qeff_home=home, progress=False)
    assert more_cores.parent == base.parent and more_cores != base
    assert (calls.exports, calls.compiles) == (1, 2)
    assert (
        "-aic-num-cores=2"
        in layout.read_json(more_cores / layout.QCONFIG_FILE)["qpc_config"]["compiler_command"]
    )
    # An export change (the IO contract drops batch_index without continuous batching): new ONNX.
    fixed = compile_model(tiny_llama, SETTINGS.replace(full_batch_size=None), qeff_home=home, progress=False)
    assert fixed.parent != base.parent
    assert (calls.exports, calls.compiles) == (2, 3)
    specs = layout.read_specializations(fixed / layout.SPECIALIZATIONS_FILE)
    assert all("full_batch_size" not in s.symbols for s in specs)


def test_changed_model_files_make_a_new_export(tiny_llama: Path, tmp_path: Path, calls: Calls) -> None:
    import shutil

    model = tmp_path / tiny_llama.name
    shutil.copytree(tiny_llama, model)
    home = tmp_path / "home"
    first = compile_model(model, SETTINGS, qeff_home=home, progress=False)
    config = json.loads((model / "config.json").read_text())
    config["rms_norm_eps"] = config["rms_norm_eps"] * 10
    (model / "config.json").write_text(json.dumps(config))
    second = compile_model(model, SETTINGS, qeff_home=home, progress=False)
    assert second.parent != first.parent
    assert calls.exports == 2


def test_unsupported_and_missing_models_fail_before_any_work(
    unsupported_model_dir: Path, tmp_path: Path, calls: Calls
) -> None:
    with pytest.raises(QaicConfigError, match="FalconMambaForCausalLM"):
        compile_model(unsupported_model_dir, SETTINGS, qeff_home=tmp_path, progress=False)
    with pytest.raises(QaicConfigError, match=r"config\.json"):
        compile_model(tmp_path, SETTINGS, qeff_home=tmp_path, progress=False)
    assert (calls.exports, calls.compiles) == (0, 0)


CHILD = textwrap.dedent(
    """
    import logging, sys
    from pathlib import Path
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    from qaic_aot import compile_model
    from qaic_core.settings import CompileSettings
    settings = CompileSettings(prefill_seq_len=8, ctx_len=64, full_batch_size=2, num_cores=1)
    print(compile_model(Path(sys.argv[1]), settings, qeff_home=Path(sys.argv[2]), progress=False))
    """
)


def test_two_processes_compiling_the_same_key(tiny_llama: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = {**os.environ, "QAIC_BACKEND": os.environ.get("QAIC_BACKEND", "sim")}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(tiny_llama), str(home)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    results = [p.communicate(timeout=600) for p in procs]
    for proc, (_, err) in zip(procs, results, strict=True):
        assert proc.returncode == 0, err
    paths = {out.strip() for out, _ in results}
    assert len(paths) == 1
    logs = "".join(err for _, err in results)
    # Exactly one process exported and compiled; the other waited on the lock and reused both.
    assert logs.count("qaic.aot.compile: exported ") == 1, logs
    assert logs.count("reusing exported model") == 1, logs
    assert logs.count("reusing compiled program") == 1, logs
    qpc = Path(paths.pop())
    assert layout.qpc_exists(qpc)
    leftovers = [p.name for p in qpc.parent.parent.rglob(".*tmp*")]
    assert leftovers == []


def test_failed_compile_leaves_no_entry(tiny_llama: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    bad = SETTINGS.replace(compiler_args=("-no-such-flag",))
    with pytest.raises(QaicError, match="no-such-flag"):
        compile_model(tiny_llama, bad, qeff_home=home, progress=False)
    export_root = next(p for p in (home / "LlamaForCausalLM").iterdir() if p.is_dir())
    assert not [p for p in export_root.iterdir() if p.is_dir()]
    # The next attempt with valid settings reuses the export and compiles cleanly.
    assert layout.qpc_exists(compile_model(tiny_llama, SETTINGS, qeff_home=home, progress=False))


def test_the_hand_built_graphs_revision_keys_the_export(
    tiny_llama: Path, tmp_path: Path, calls: Calls, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cache written before the graph changed is not reused for the changed graph."""
    from qaic_aot.export import decoder

    home = tmp_path / "home"
    params = aot_compile.export_params(tiny_llama, "LlamaForCausalLM", SETTINGS)
    assert (params["route"], params["graph_revision"]) == ("graph", decoder.GRAPH_REVISION)
    before = compile_model(tiny_llama, SETTINGS, qeff_home=home, progress=False)
    assert compile_model(tiny_llama, SETTINGS, qeff_home=home, progress=False) == before
    assert calls.exports == 1
    monkeypatch.setattr(decoder, "GRAPH_REVISION", decoder.GRAPH_REVISION + 1)
    after = compile_model(tiny_llama, SETTINGS, qeff_home=home, progress=False)
    assert after.parent != before.parent  # a new export entry
    assert calls.exports == 2


def test_the_simulators_attention_setting_keys_the_program(
    tiny_llama: Path, tmp_path: Path, calls: Calls, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The backend's compiler revision is part of the program's key: a program compiled with the
    simulator's fused attention off is not reused once it is on, and the export is."""
    from qaic_sim.machine import reset_machine

    home = tmp_path / "home"
    monkeypatch.setenv("QAIC_SIM_FUSED_ATTENTION", "0")
    reset_machine()
    plain = compile_model(tiny_llama, SETTINGS, qeff_home=home, progress=False)
    monkeypatch.delenv("QAIC_SIM_FUSED_ATTENTION")
    reset_machine()
    fused = compile_model(tiny_llama, SETTINGS, qeff_home=home, progress=False)
    assert fused != plain and fused.parent.parent == plain.parent.parent
    assert (calls.exports, calls.compiles) == (1, 2)
    assert compile_model(tiny_llama, SETTINGS, qeff_home=home, progress=False) == fused
    assert calls.compiles == 2


def test_the_traced_routes_revision_keys_the_export(tiny_llama: Path) -> None:
    """A traced export made before the traced graph changed (RMSNorm as ``CustomRMSNorm``) is not reused."""
    from qaic_aot.export.traced.export import TRACED_REVISION

    params = aot_compile.export_params(tiny_llama, "Gemma2ForCausalLM", SETTINGS)
    assert (params["route"], params["traced_revision"]) == ("traced", TRACED_REVISION)
    assert "traced_revision" not in aot_compile.export_params(tiny_llama, "LlamaForCausalLM", SETTINGS)
