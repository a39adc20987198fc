"""The docs say what the code does: served architectures, step capabilities and class names are read from the code."""

from __future__ import annotations

import ast
import importlib
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from qaic_core import get_plugin_manager
from qaic_core.descriptors import ExecutionPath
from qaic_core.execution import STEP_CAPABILITIES

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PACKAGES = sorted(p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").is_file())

ARCHITECTURE_NAME = re.compile(
    r"[A-Z][A-Za-z0-9]*(?:ForCausalLM|LMHeadModel|ForSequenceClassification|Model)"
)
"""How a Hugging Face architecture name looks (``LlamaForCausalLM``, ``GPT2LMHeadModel``, ``BertModel``)."""
CHECKED_CLASS = re.compile(r"(?:Qaic|QAIC)[A-Z]\w*|[A-Z]\w*(?:Runner|Worker|Scheduler)|Scheduler")
"""The class names whose every mention the docs must keep true: ours (``Qaic*``) and the serving roles."""
VLLM_CLASSES = {
    "Scheduler": "vllm.v1.core.sched.scheduler",
    "AsyncScheduler": "vllm.v1.core.sched.async_scheduler",
}
"""vLLM's classes the docs name beside ours, with the module that defines them (checked to exist)."""

GENERATE, POOLING = "generate", "pooling"
SUPPORT_MATRIX_SECTIONS = {
    "Compile path (`qaic-aot`)": ("aot", GENERATE),
    "Pooling models (`--runner pooling`)": ("aot", POOLING),
    "Eager (pyt) execution mode": ("pyt", GENERATE),
}
"""docs/support-matrix.md's sections that list one path's architectures: heading -> (path, runner)."""


def class_names_in_source() -> set[str]:
    """Every class defined anywhere in packages/*/src, read from the syntax tree (no imports)."""
    names: set[str] = set()
    for path in (ROOT / "packages").glob("*/src/**/*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        names.update(node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef))
    return names


def served_paths() -> dict[str, ExecutionPath]:
    """This repository's execution paths as qaic-core's plugin manager registers them."""
    paths = {name: p for name, p in get_plugin_manager().execution_paths().items() if p.package in PACKAGES}
    assert {"aot", "pyt"} <= set(paths), f"the plugin manager returned only {sorted(paths)}"
    return paths


def served(path: ExecutionPath, runner: str) -> set[str]:
    return set(path.pooling_architectures if runner == POOLING else path.architectures)


def sections(text: str) -> dict[str, str]:
    """A page's level-2 sections by heading (subsections stay inside their section)."""
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return {heading.strip(): body for heading, body in zip(parts[1::2], parts[2::2], strict=True)}


def code_spans(text: str) -> Iterator[str]:
    """Fenced blocks and inline code spans of a markdown page."""
    fenced = re.compile(r"^```[^\n]*\n(.*?)^```", flags=re.M | re.S)
    yield from fenced.findall(text)
    yield from re.findall(r"`([^`\n]+)`", fenced.sub("", text))


def architecture_names(text: str, own_classes: set[str]) -> set[str]:
    """Backticked Hugging Face architecture names, leaving out our own classes (``PagedStepModel``)."""
    found = {span for span in re.findall(r"`([^`\n]+)`", text) if ARCHITECTURE_NAME.fullmatch(span)}
    return found - own_classes


def table_rows(text: str) -> list[list[str]]:
    """The cells of every markdown table row except header separators."""
    rows = []
    for line in text.splitlines():
        if line.startswith("|") and not re.fullmatch(r"\|[-| :]+\|", line.strip()):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def vllm_architecture_table() -> dict[tuple[str, str], set[str]]:
    """docs/vllm.md's "Architectures" table: (path, runner) -> the architectures its row lists."""
    body = sections((DOCS / "vllm.md").read_text()).get("Architectures")
    assert body is not None, "docs/vllm.md has no '## Architectures' section"
    table: dict[tuple[str, str], set[str]] = {}
    for first, *rest in table_rows(body)[1:]:
        path = re.match(r"`([a-z]+)`", first)
        assert path is not None and rest, (
            f"docs/vllm.md's architecture row {first!r} does not start with a path"
        )
        key = (path.group(1), POOLING if "pooling" in first else GENERATE)
        assert key not in table, f"docs/vllm.md lists {key} twice"
        table[key] = set(re.findall(r"`([^`]+)`", " ".join(rest)))
    return table


def difference(documented: set[str], code: set[str], where: str) -> str:
    return (
        f"{where}: in the docs only {sorted(documented - code)}; in the code only {sorted(code - documented)}"
    )


def test_vllm_md_lists_each_paths_architectures() -> None:
    table = vllm_architecture_table()
    expected = {
        (name, runner): served(path, runner)
        for name, path in served_paths().items()
        for runner in (GENERATE, POOLING)
        if served(path, runner)
    }
    assert set(table) == set(expected), (
        f"docs/vllm.md's architecture rows {sorted(table)}, paths {sorted(expected)}"
    )
    wrong = [
        difference(table[key], expected[key], f"{key[0]} {key[1]}")
        for key in expected
        if table[key] != expected[key]
    ]
    assert not wrong, "docs/vllm.md's Architectures table differs from the code:\n" + "\n".join(wrong)


@pytest.mark.parametrize("page", ["vllm.md", "support-matrix.md"])
def test_no_page_names_an_architecture_nothing_serves(page: str) -> None:
    every = set().union(
        *(served(p, runner) for p in served_paths().values() for runner in (GENERATE, POOLING))
    )
    named = architecture_names((DOCS / page).read_text(), class_names_in_source())
    assert named, f"docs/{page} names no architecture: has the pattern stopped matching?"
    assert not named - every, f"docs/{page} names architectures no path serves: {sorted(named - every)}"


@pytest.mark.parametrize(
    ("heading", "key"),
    list(SUPPORT_MATRIX_SECTIONS.items()),
    ids=[f"{p}-{r}" for p, r in SUPPORT_MATRIX_SECTIONS.values()],
)
def test_support_matrix_lists_each_paths_architectures(heading: str, key: tuple[str, str]) -> None:
    body = sections((DOCS / "support-matrix.md").read_text()).get(heading)
    assert body is not None, f"docs/support-matrix.md has no '## {heading}' section"
    documented = architecture_names(body, class_names_in_source())
    code = served(served_paths()[key[0]], key[1])
    assert documented == code, difference(documented, code, f"docs/support-matrix.md '{heading}'")


def test_vllm_md_lists_the_step_capabilities() -> None:
    body = sections((DOCS / "vllm.md").read_text()).get("How a step runs", "")
    _, found, table = body.partition("### Step capabilities")
    assert found, "docs/vllm.md has no '### Step capabilities' under '## How a step runs'"
    documented = {re.sub(r"^`|`$", "", row[0]) for row in table_rows(table)[1:]}
    assert documented == set(STEP_CAPABILITIES), difference(
        documented, set(STEP_CAPABILITIES), "step capabilities"
    )


def test_architecture_md_lists_the_step_capabilities() -> None:
    text = (DOCS / "architecture.md").read_text()
    listed = re.search(r"capability names \(`STEP_CAPABILITIES`: ([^;)]+)", text)
    assert listed is not None, "docs/architecture.md no longer lists the step capability names"
    documented = set(re.findall(r"`([^`]+)`", listed.group(1)))
    assert documented == set(STEP_CAPABILITIES), difference(
        documented, set(STEP_CAPABILITIES), "step capabilities"
    )


@pytest.mark.parametrize("page", ["architecture.md", "vllm.md"])
def test_named_classes_exist(page: str) -> None:
    ours = class_names_in_source()
    named = {
        name
        for span in code_spans((DOCS / page).read_text())
        for name in re.findall(r"[A-Za-z_]\w*", span)
        if CHECKED_CLASS.fullmatch(name)
    }
    assert named, f"docs/{page} names no class: has the pattern stopped matching?"
    missing = sorted(name for name in named - ours if name not in VLLM_CLASSES)
    assert not missing, f"docs/{page} names classes that no package defines: {missing}"
    for name in sorted(named & set(VLLM_CLASSES)):
        assert hasattr(importlib.import_module(VLLM_CLASSES[name]), name), f"vLLM no longer defines {name}"


def test_the_class_check_can_fail() -> None:
    """A class that was renamed away is caught (the check is not vacuous)."""
    ours = class_names_in_source()
    assert "QaicWorker" in ours and "AotModelRunner" not in ours
    assert CHECKED_CLASS.fullmatch("AotModelRunner") and ARCHITECTURE_NAME.fullmatch("GPT2LMHeadModel")


DOTTED = re.compile(r"`(qaic_[a-z_]+(?:\.[A-Za-z_][A-Za-z_0-9]*)+)(?:\(\))?`")
FILE_SUFFIXES = (".json", ".yaml", ".yml", ".txt", ".bin", ".md")


def _resolves(dotted: str) -> bool:
    """``qaic_x.module.Name`` names an importable module and, after it, attributes that exist."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_dotted_names_in_the_docs_exist() -> None:
    """A module, class or function the docs name by its dotted path (``qaic_vllm.runner.paged.PagedModelRunner``) exists."""
    missing = sorted(
        {
            f"{doc.name}: {name}"
            for doc in [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
            for name in DOTTED.findall(doc.read_text())
            if not name.endswith(FILE_SUFFIXES) and not _resolves(name)
        }
    )
    assert not missing, f"the docs name what the code does not have: {missing}"
