"""A trustworthy cache: checksummed entries, damaged ones moved aside and rebuilt, damaged prebuilt QPCs refused."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from test_cache import SETTINGS, Calls

from qaic_aot import compile_model, integrity, validate_qpc
from qaic_aot import step_model as aot_step_model
from qaic_core import get_plugin_manager
from qaic_core import qpc as layout
from qaic_core.errors import QaicConfigError
from qaic_core.execution import ExecutionConfig


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Calls:
    return Calls(monkeypatch)


def _compile(model: Path, home: Path) -> Path:
    return compile_model(model, SETTINGS, qeff_home=home, progress=False)


def _warnings(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _garbage(path: Path) -> None:
    """Overwrite in place with as many bytes, so only the checksum can tell."""
    size = path.stat().st_size
    path.write_bytes(bytes((i * 7 + 3) % 256 for i in range(size)))


def test_entries_record_the_checksums_of_their_files(tiny_llama: Path, tmp_path: Path) -> None:
    qpc = _compile(tiny_llama, tmp_path / "home")
    _, files = integrity.read_manifest(qpc)
    program = qpc / "qpc" / layout.PROGRAM_FILE
    assert files[integrity.PROGRAM_MEMBER].sha256 == hashlib.sha256(program.read_bytes()).hexdigest()
    assert files[integrity.PROGRAM_MEMBER].size == program.stat().st_size
    assert {layout.COMPILE_PARAMS_FILE, layout.QCONFIG_FILE, layout.SPECIALIZATIONS_FILE} <= set(files)
    kind, exported = integrity.read_manifest(qpc.parent)
    assert kind == "export"
    assert set(exported) == {f"{tiny_llama.name}.onnx", layout.EXPORT_PARAMS_FILE}
    # QEfficient's files are where they were.
    assert (qpc.parent / layout.EXPORT_PARAMS_FILE).is_file() and layout.qpc_exists(qpc)


@pytest.mark.parametrize(("damage", "said"), [(_truncate, "truncated"), (_garbage, "sha256")])
def test_a_damaged_cached_program_is_moved_aside_and_rebuilt(
    tiny_llama: Path,
    tmp_path: Path,
    calls: Calls,
    caplog: pytest.LogCaptureFixture,
    damage: Callable[[Path], None],
    said: str,
) -> None:
    home = tmp_path / "home"
    qpc = _compile(tiny_llama, home)
    program = qpc / "qpc" / layout.PROGRAM_FILE
    damage(program)
    bad = program.read_bytes()
    with caplog.at_level(logging.INFO, logger="qaic.aot"):
        assert _compile(tiny_llama, home) == qpc
    assert (calls.exports, calls.compiles) == (1, 2)
    assert program.read_bytes() != bad
    aside = [p for p in qpc.parent.iterdir() if p.name.startswith(f"{qpc.name}.corrupt-")]
    assert len(aside) == 1 and (aside[0] / "qpc" / layout.PROGRAM_FILE).read_bytes() == bad
    warning = _warnings(caplog)
    assert str(qpc) in warning and said in warning and "compiling it again" in warning
    assert str(aside[0]) in warning
    validate_qpc(qpc, tiny_llama, SETTINGS)


def test_a_partial_entry_without_its_marker_is_rebuilt(
    tiny_llama: Path, tmp_path: Path, calls: Calls, caplog: pytest.LogCaptureFixture
) -> None:
    home = tmp_path / "home"
    qpc = _compile(tiny_llama, home)
    # An interrupted copy: the small files arrived, the program and the manifest did not.
    (qpc / integrity.MANIFEST_FILE).unlink()
    (qpc / "qpc" / layout.PROGRAM_FILE).unlink()
    with caplog.at_level(logging.INFO, logger="qaic.aot"):
        assert _compile(tiny_llama, home) == qpc
    assert calls.compiles == 2
    assert "completion marker" in _warnings(caplog) and str(qpc) in _warnings(caplog)
    assert (qpc / integrity.MANIFEST_FILE).is_file()
    validate_qpc(qpc, tiny_llama, SETTINGS)


def test_an_entry_from_an_earlier_version_is_adopted_when_it_reads(
    tiny_llama: Path, tmp_path: Path, calls: Calls, caplog: pytest.LogCaptureFixture
) -> None:
    home = tmp_path / "home"
    qpc = _compile(tiny_llama, home)
    (qpc / integrity.MANIFEST_FILE).unlink()
    (qpc.parent / integrity.MANIFEST_FILE).unlink()
    with caplog.at_level(logging.INFO, logger="qaic.aot"):
        assert _compile(tiny_llama, home) == qpc
    assert (calls.exports, calls.compiles) == (1, 1)
    assert "earlier version" in caplog.text and not _warnings(caplog)
    assert integrity.verify(qpc, (integrity.PROGRAM_MEMBER,), update=False) is None
    assert (qpc.parent / integrity.MANIFEST_FILE).is_file()


def test_an_unreadable_entry_from_an_earlier_version_is_rebuilt(
    tiny_llama: Path, tmp_path: Path, calls: Calls, caplog: pytest.LogCaptureFixture
) -> None:
    home = tmp_path / "home"
    qpc = _compile(tiny_llama, home)
    (qpc / integrity.MANIFEST_FILE).unlink()
    _truncate(qpc / "qpc" / layout.PROGRAM_FILE)
    with caplog.at_level(logging.INFO, logger="qaic.aot"):
        assert _compile(tiny_llama, home) == qpc
    assert calls.compiles == 2
    assert "truncated or corrupt" in _warnings(caplog)


def test_a_touched_but_intact_program_is_hashed_once_and_reused(
    tiny_llama: Path, tmp_path: Path, calls: Calls
) -> None:
    home = tmp_path / "home"
    qpc = _compile(tiny_llama, home)
    program = qpc / "qpc" / layout.PROGRAM_FILE
    st = program.stat()
    os.utime(program, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert _compile(tiny_llama, home) == qpc
    assert calls.compiles == 1
    _, files = integrity.read_manifest(qpc)
    assert files[integrity.PROGRAM_MEMBER].mtime_ns == program.stat().st_mtime_ns
    stamped = (qpc / integrity.MANIFEST_FILE).stat().st_mtime_ns
    assert _compile(tiny_llama, home) == qpc
    assert (qpc / integrity.MANIFEST_FILE).stat().st_mtime_ns == stamped


def test_a_damaged_onnx_is_exported_again_and_the_program_kept(
    tiny_llama: Path, tmp_path: Path, calls: Calls, caplog: pytest.LogCaptureFixture
) -> None:
    home = tmp_path / "home"
    qpc = _compile(tiny_llama, home)
    onnx = qpc.parent / f"{tiny_llama.name}.onnx"
    _truncate(onnx)
    with caplog.at_level(logging.INFO, logger="qaic.aot"):
        assert _compile(tiny_llama, home) == qpc
    assert (calls.exports, calls.compiles) == (2, 1)
    assert str(onnx) in _warnings(caplog) and "exporting it again" in _warnings(caplog)
    aside = [p for p in qpc.parent.parent.iterdir() if p.name.startswith(f"{qpc.parent.name}.corrupt-")]
    assert len(aside) == 1 and (aside[0] / onnx.name).is_file()
    assert integrity.verify(qpc.parent, (onnx.name,), update=False) is None


def _config(model: Path, qpc_path: Path) -> ExecutionConfig:
    device = get_plugin_manager().select_device_backend()
    return ExecutionConfig(
        model_dir=model, settings=SETTINGS, device=device, qpc_path=qpc_path, progress=False
    )


def _assert_names_file_and_fix(message: str, program: Path) -> None:
    assert str(program) in message
    assert "qaic-aot compile" in message and "qpc_path" in message


def test_a_damaged_prebuilt_entry_fails_at_configuration(tiny_llama: Path, tmp_path: Path) -> None:
    prebuilt = shutil.copytree(_compile(tiny_llama, tmp_path / "home"), tmp_path / "prebuilt")
    program = prebuilt / "qpc" / layout.PROGRAM_FILE
    aot_step_model.check(_config(tiny_llama, prebuilt))
    _truncate(program)
    with pytest.raises(QaicConfigError, match="truncated") as err:
        aot_step_model.check(_config(tiny_llama, prebuilt))
    _assert_names_file_and_fix(str(err.value), program)
    with pytest.raises(QaicConfigError, match="truncated") as err:
        validate_qpc(prebuilt, tiny_llama, SETTINGS)
    _assert_names_file_and_fix(str(err.value), program)
    assert program.stat().st_size > 0 and prebuilt.is_dir()  # never moved or rebuilt


@pytest.mark.parametrize("damage", [_truncate, _garbage])
def test_a_damaged_prebuilt_program_without_checksums_fails_at_configuration(
    tiny_llama: Path, tmp_path: Path, damage: Callable[[Path], None]
) -> None:
    folder = shutil.copytree(_compile(tiny_llama, tmp_path / "home") / "qpc", tmp_path / "program-only")
    program = folder / layout.PROGRAM_FILE
    damage(program)
    with pytest.raises(QaicConfigError, match="truncated or corrupt") as err:
        aot_step_model.check(_config(tiny_llama, folder))
    _assert_names_file_and_fix(str(err.value), program)
    with pytest.raises(QaicConfigError, match="truncated or corrupt") as err:
        validate_qpc(folder, tiny_llama, SETTINGS)
    _assert_names_file_and_fix(str(err.value), program)


def test_a_missing_prebuilt_program_fails_at_configuration(tiny_llama: Path, tmp_path: Path) -> None:
    with pytest.raises(QaicConfigError, match=r"programqpc\.bin is missing"):
        aot_step_model.check(_config(tiny_llama, tmp_path))
