"""The family ships in lockstep: one version everywhere, exact pins between qaic packages."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYPROJECTS = sorted((ROOT / "packages").glob("*/pyproject.toml"))


def _load(path: Path) -> dict:
    return tomllib.loads(path.read_text())["project"]


def test_every_package_is_present() -> None:
    names = {_load(p)["name"] for p in PYPROJECTS}
    assert names == {
        "qaic-core",
        "qaic-sim",
        "qaic-aot",
        "qaic-pyt",
        "qaic-vllm",
        "qaic-kvconnector",
        "qaic-bench",
    }


def test_one_version_and_exact_pins() -> None:
    core_version = _load(ROOT / "packages/qaic-core/pyproject.toml")["version"]
    problems = []
    for path in PYPROJECTS:
        project = _load(path)
        if project["version"] != core_version:
            problems.append(f"{project['name']} is {project['version']}, family is {core_version}")
        for dep in project.get("dependencies", []):
            match = re.match(r"^(qaic-[a-z]+)\s*(.*)$", dep)
            if match and match.group(2) != f"=={core_version}":
                problems.append(f"{project['name']} pins {dep!r}; expected {match.group(1)}=={core_version}")
    assert not problems, problems


def test_module_versions_match_distributions() -> None:
    for path in PYPROJECTS:
        project = _load(path)
        module = project["name"].replace("-", "_")
        init = path.parent / "src" / module / "__init__.py"
        found = re.search(r'__version__ = "([^"]+)"', init.read_text())
        assert found and found.group(1) == project["version"], init
