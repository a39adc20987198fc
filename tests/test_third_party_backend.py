"""A device backend from outside this repository plugs in through the documented public API alone.

This builds a throwaway distribution the way a vendor would (see docs/plugins.md, "Writing a device
backend"): a hatchling ``pyproject.toml`` with an entry point in the ``qaic`` group and a module whose
``qaic_device_backends`` hook returns a ``DeviceBackend``. Here the backend wraps the simulator's
runtime and compiler under the name ``acme``. It is installed with pip into a folder of its own, and
the conformance suite and ``QAIC_BACKEND`` selection then run in fresh interpreters.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PYPROJECT = """\
[build-system]
requires = ["hatchling>=1.24"]
build-backend = "hatchling.build"

[project]
name = "acme-qaic-backend"
version = "0.3.0"
description = "Acme accelerator cards for the qaic stack."
requires-python = ">=3.11"
dependencies = ["qaic-core", "qaic-sim"]

[project.entry-points."qaic"]
acme = "acme_qaic.plugin"

[tool.hatch.build.targets.wheel]
packages = ["src/acme_qaic"]
"""

PLUGIN = '''\
"""Registers Acme cards as the ``acme`` device backend (the qaic simulator underneath)."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from types import ModuleType

from qaic_core import hookimpl
from qaic_core.descriptors import DeviceBackend


def runtime() -> ModuleType:
    """The qaicrt-compatible runtime module, imported only when a backend is used."""
    from qaic_sim import qaicrt

    return qaicrt


def aicapi() -> ModuleType:
    """The module whose IoDesc parses Qpc.getIoDescriptor() bytes."""
    from qaic_sim import aicapi as module

    return module


def compile_qpc(argv: Sequence[str]) -> None:
    """Compile like qaic-compile (argv without the program name); raises on failure."""
    from qaic_sim.compiler import compile_argv

    compile_argv(list(argv))


def is_available() -> bool:
    """Cheap probe: no device is opened while backends are listed."""
    return importlib.util.find_spec("qaic_sim") is not None


@hookimpl
def qaic_device_backends() -> list[DeviceBackend]:
    return [
        DeviceBackend(
            name="acme",
            package="acme-qaic-backend",
            runtime=runtime,
            aicapi=aicapi,
            is_available=is_available,
            compiler=compile_qpc,
            priority=1,
            capabilities=frozenset({"compile", "retained_state", "slicing"}),
            description="Acme cards (the qaic simulator underneath)",
        )
    ]
'''

SELECT = """
import json
from qaic_core import get_plugin_manager
pm = get_plugin_manager()
backend = pm.select_device_backend()
rt = backend.runtime()
json.dump({"name": backend.name, "package": backend.package, "runtime": rt.__name__,
           "errors": pm.load_errors}, __import__("sys").stdout)
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The acme package built and installed with pip into a folder of its own."""
    root = tmp_path_factory.mktemp("acme")
    pkg = root / "acme-qaic-backend"
    (pkg / "src" / "acme_qaic").mkdir(parents=True)
    (pkg / "pyproject.toml").write_text(PYPROJECT)
    (pkg / "src" / "acme_qaic" / "__init__.py").write_text('"""Acme cards for qaic."""\n')
    (pkg / "src" / "acme_qaic" / "plugin.py").write_text(PLUGIN)
    target = root / "site"
    env = os.environ | {"PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    pip = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "-q"]
    subprocess.run(
        [*pip, "--target", str(target), str(pkg)],
        check=True,
        env=env,
        timeout=240,
    )
    assert (target / "acme_qaic" / "plugin.py").is_file()
    return target


def _run(site: Path, args: list[str], **extra: str) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    env = os.environ | {"PYTHONPATH": path, "QAIC_STRICT_PLUGINS": "1"} | extra
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, cwd=site, timeout=240
    )


@pytest.mark.timeout(600)
def test_conformance_suite_passes_on_a_third_party_backend(site: Path) -> None:
    result = _run(site, ["-m", "qaic_core.testing", "--backend", "acme", "-p", "no:cacheprovider"])
    output = result.stdout[-4000:] + result.stderr[-2000:]
    assert result.returncode == 0, output
    assert " passed" in result.stdout and "failed" not in result.stdout, output
    # acme does not claim multi_device, so the suite skips what needs it instead of failing.
    assert "skipped" in result.stdout, output


@pytest.mark.timeout(300)
def test_qaic_backend_selects_the_third_party_backend(site: Path) -> None:
    result = _run(site, ["-c", SELECT], QAIC_BACKEND="acme")
    assert result.returncode == 0, result.stderr[-4000:]
    found = json.loads(result.stdout)
    assert found["name"] == "acme" and found["package"] == "acme-qaic-backend"
    assert found["runtime"] == "qaic_sim.qaicrt"
    assert found["errors"] == {}
