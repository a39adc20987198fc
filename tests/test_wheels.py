"""Each wheel, installed alone in a fresh environment, carries its entry points.

A wheel built without its entry points is silently ignored by the plugin manager and by vLLM,
so this builds every package's wheel and reads the entry points back from a fresh venv.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p.parent for p in (ROOT / "packages").glob("*/pyproject.toml"))

PROBE = """
import importlib.metadata as md, importlib.util, json, sys
found = {}
for group in ("qaic", "vllm.platform_plugins", "vllm.general_plugins"):
    for ep in md.entry_points(group=group):
        module = ep.value.split(":")[0]
        spec = importlib.util.find_spec(module.split(".")[0])
        found[f"{group}:{ep.name}"] = {"value": ep.value, "dist": ep.dist.name, "importable_top": spec is not None}
scripts = {}
for dist in md.distributions():
    for ep in dist.entry_points:
        if ep.group == "console_scripts":
            scripts[ep.name] = ep.value
json.dump({"entry_points": found, "scripts": scripts}, sys.stdout)
"""


@pytest.fixture(scope="module")
def wheel_env(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("wheels")
    dist = tmp / "dist"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(dist),
            *map(str, PACKAGES),
        ],
        check=True,
    )
    wheels = sorted(dist.glob("*.whl"))
    assert len(wheels) == len(PACKAGES), wheels
    env_dir = tmp / "venv"
    venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
    python = env_dir / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", *map(str, wheels)], check=True
    )
    out = subprocess.run([str(python), "-c", PROBE], check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def _declared() -> dict[str, tuple[str, str]]:
    declared = {}
    for pkg in PACKAGES:
        project = tomllib.loads((pkg / "pyproject.toml").read_text())["project"]
        for group, eps in project.get("entry-points", {}).items():
            for name, value in eps.items():
                declared[f"{group}:{name}"] = (value, project["name"])
    return declared


def test_every_declared_entry_point_is_in_the_wheels(wheel_env: dict) -> None:
    declared = _declared()
    assert declared, "no entry points declared"
    for key, (value, dist) in declared.items():
        assert key in wheel_env["entry_points"], f"{dist} wheel lacks entry point {key}"
        got = wheel_env["entry_points"][key]
        assert got["value"] == value and got["dist"] == dist
        assert got["importable_top"], f"{key}: module of {value} is not inside the installed wheels"


def test_the_platform_and_backend_entry_points_exist(wheel_env: dict) -> None:
    eps = wheel_env["entry_points"]
    assert "vllm.platform_plugins:qaic" in eps
    assert "qaic:sim" in eps


def test_console_scripts_are_installed(wheel_env: dict) -> None:
    for script in ("qaic-sim", "qaic-aot", "qaic-vllm", "qaic-bench"):
        assert script in wheel_env["scripts"], script
