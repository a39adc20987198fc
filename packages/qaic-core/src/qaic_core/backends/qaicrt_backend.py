"""The real Cloud AI runtime: available when the Platform SDK's ``qaicrt`` module imports."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import cast

from qaic_core import hookimpl
from qaic_core.descriptors import DeviceBackend
from qaic_core.errors import QaicError
from qaic_core.runtime import AicApiModule, QaicrtModule

SDK_ROOT = Path(os.environ.get("QAIC_SDK_ROOT", "/opt/qti-aic"))
SDK_PYTHON_DIR = SDK_ROOT / "dev" / "lib" / "x86_64"
COMPILERS = (SDK_ROOT / "exec" / "qaic-compile", SDK_ROOT / "exec" / "qaic-exec")


def _import(name: str) -> ModuleType:
    if SDK_PYTHON_DIR.is_dir() and str(SDK_PYTHON_DIR) not in sys.path:
        sys.path.append(str(SDK_PYTHON_DIR))
    return importlib.import_module(name)


# The SDK's modules are compiled and untyped: the casts are checked at run time by the
# conformance suite (``python -m qaic_core.testing --backend qaicrt``), which finds every
# member of the Protocols on them.
def runtime() -> QaicrtModule:
    return cast(QaicrtModule, _import("qaicrt"))


def aicapi() -> AicApiModule:
    return cast(AicApiModule, _import("QAicApi_pb2"))


def is_available() -> bool:
    try:
        runtime()
    except ImportError:
        return False
    return True


def compiler_path() -> Path | None:
    for candidate in COMPILERS:
        if candidate.exists():
            return candidate
    found = shutil.which("qaic-compile") or shutil.which("qaic-exec")
    return Path(found) if found else None


def compile_qpc(args: Sequence[str]) -> None:
    exe = compiler_path()
    if exe is None:
        raise QaicError("qaic-compile was not found: install the Cloud AI Apps SDK or set QAIC_SDK_ROOT")
    result = subprocess.run([str(exe), *args], check=False, capture_output=True, text=True)
    if result.stdout:
        sys.stdout.write(result.stdout)
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-20:])
        raise QaicError(f"{exe.name} failed with exit code {result.returncode}:\n{tail}")


@hookimpl
def qaic_device_backends() -> list[DeviceBackend]:
    return [
        DeviceBackend(
            name="qaicrt",
            package="qaic-core",
            runtime=runtime,
            aicapi=aicapi,
            is_available=is_available,
            compiler=compile_qpc,
            priority=100,
            capabilities=frozenset(
                {"compile", "retained_state", "multi_device", "mxfp6", "mxint8", "fp16", "slicing", "timing"}
            ),
            description="Cloud AI 100 cards through the Platform SDK's qaicrt",
        )
    ]
