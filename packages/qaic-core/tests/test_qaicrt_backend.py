"""The real-card backend runs qaic-compile and reports its errors (checked with a stand-in binary)."""

from __future__ import annotations

from pathlib import Path

import pytest

from qaic_core.backends import qaicrt_backend
from qaic_core.errors import QaicError


def test_compiler_failure_carries_the_compilers_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    exe = tmp_path / "qaic-compile"
    exe.write_text("#!/bin/sh\necho 'compiling'\necho \"unknown option: $1\" >&2\nexit 3\n")
    exe.chmod(0o755)
    monkeypatch.setattr(qaicrt_backend, "compiler_path", lambda: exe)
    with pytest.raises(QaicError, match=r"exit code 3:\nunknown option: -no-such-flag"):
        qaicrt_backend.compile_qpc(["-no-such-flag"])


def test_missing_compiler_names_the_sdk(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(qaicrt_backend, "compiler_path", lambda: None)
    with pytest.raises(QaicError, match="QAIC_SDK_ROOT"):
        qaicrt_backend.compile_qpc([])
