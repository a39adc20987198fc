"""The packages import each other as docs/architecture.md says: serving code reaches paths and backends through qaic-core."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").is_file())


def module_of(package: str) -> str:
    return package.replace("-", "_")


def imported_packages(package: str) -> set[str]:
    """The other qaic packages whose modules ``package``'s source imports (at any depth, lazily or not)."""
    modules = {module_of(p): p for p in PACKAGES}
    found: set[str] = set()
    for path in (ROOT / "packages" / package / "src").rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top in modules and modules[top] != package:
                    found.add(modules[top])
    return found


def documented() -> dict[str, set[str]]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    table: dict[str, set[str]] = {}
    for package, imports in re.findall(r"^\| `(qaic-[a-z]+)` \| (.+?) \|$", text, flags=re.M):
        table[package] = set(re.findall(r"`(qaic-[a-z]+)`", imports))
    return table


def test_every_package_is_in_the_table() -> None:
    assert set(documented()) == set(PACKAGES)


def test_imports_follow_the_documented_layers() -> None:
    table = documented()
    wrong = {p: sorted(imported_packages(p) - table[p]) for p in PACKAGES if imported_packages(p) - table[p]}
    assert not wrong, f"imports that docs/architecture.md does not allow: {wrong}"


def test_serving_code_imports_no_execution_path_or_backend() -> None:
    assert imported_packages("qaic-vllm") <= {"qaic-core"}
    assert imported_packages("qaic-kvconnector") <= {"qaic-core", "qaic-sim"}  # see the table
