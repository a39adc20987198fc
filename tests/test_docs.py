"""Docs cannot drift: every hook and core env var is documented and every local link resolves."""

from __future__ import annotations

import re
from pathlib import Path

from qaic_core import env, hookspecs

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def test_every_hook_is_documented() -> None:
    text = (DOCS / "plugins.md").read_text()
    hooks = [name for name in dir(hookspecs) if name.startswith("qaic_")]
    assert hooks
    for hook in hooks:
        assert f"### `{hook}`" in text, f"docs/plugins.md does not document {hook}"


def test_core_environment_variables_are_documented() -> None:
    text = (DOCS / "configuration.md").read_text()
    core = (
        env.QAIC_BACKEND,
        env.QAIC_STRICT_PLUGINS,
        env.QAIC_TRACE_PLUGINS,
        env.QAIC_VISIBLE_DEVICES,
        env.QEFF_HOME,
    )
    for var in core:
        assert f"`{var}`" in text, var


def test_local_links_resolve() -> None:
    broken = []
    for page in [ROOT / "README.md", *DOCS.glob("*.md")]:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.name} -> {target}")
    assert not broken, broken


def test_readme_has_the_two_quick_start_commands() -> None:
    text = (ROOT / "README.md").read_text()
    assert "nox -s serve" in text and "nox -s test-sim" in text
