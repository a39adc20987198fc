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


# -- private names of vLLM, torch and argparse: only qaic_vllm.compat reaches them ----------------------
FOREIGN = ("vllm", "torch", "argparse")
"""Packages whose private names qaic-vllm may reach only through qaic_vllm.compat."""
KNOWN_PRIVATE = frozenset(
    {
        "_preempt_request",
        "_update_after_schedule",
        "_set_default_max_num_seqs_and_batched_tokens_args",
        "_actions",
        "_load_st_projector",
        "_register_device_module",
        "_get_privateuse1_backend_name",
        "grammar_compile_error_reqs",
        "max_num_active_reqs",
    }
)
"""vLLM/torch/argparse internals reached on objects whose type the source does not name (``self``, a parser)."""
COMPAT = ROOT / "packages" / "qaic-vllm" / "src" / "qaic_vllm" / "compat"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _foreign(module: str) -> bool:
    return module.split(".")[0] in FOREIGN


def private_uses(source: str) -> set[str]:
    """What ``source`` reaches of vLLM's, torch's or argparse's private names (our own ``self._x`` is fine)."""
    tree = ast.parse(source)
    bound: set[str] = set()  # names bound by an import from a foreign package
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _foreign(alias.name):
                    bound.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and _foreign(node.module):
            for alias in node.names:
                bound.add(alias.asname or alias.name)
                if _private(alias.name):
                    found.add(f"imports {node.module}.{alias.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(node.value, ast.Name) and node.value.id in bound and _private(node.attr):
                found.add(f"reaches {node.value.id}.{node.attr}")
            elif node.attr in KNOWN_PRIVATE:
                found.add(f"reaches .{node.attr}")
            if isinstance(node.ctx, ast.Store) and isinstance(root, ast.Name) and root.id in bound:
                found.add(f"assigns {ast.unparse(node)}")
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name in KNOWN_PRIVATE:
            found.add(f"overrides {node.name}")
        elif isinstance(node, ast.Constant) and node.value in KNOWN_PRIVATE:
            found.add(f"names {node.value!r}")
    return found


def vllm_modules() -> dict[str, Path]:
    src = ROOT / "packages" / "qaic-vllm" / "src"
    return {
        path.relative_to(src).as_posix(): path
        for path in sorted(src.rglob("*.py"))
        if COMPAT not in path.parents
    }


def test_the_private_name_check_finds_each_kind_and_spares_our_own() -> None:
    source = """
import torch
from vllm.model_executor.models.adapters import _load_st_projector
from vllm.v1.core.sched.scheduler import Scheduler

class Ours(Scheduler):
    def _update_after_schedule(self, so):
        Scheduler._update_after_schedule(self, so)
        self._own_field = 1
        self._own_method()
        self.max_num_active_reqs = 2
        torch._C._get_privateuse1_backend_name()
        torch.accelerator.synchronize = None
        getattr(parser, "_actions", [])

def plain(parser, other):
    return other._private, parser.option_strings, torch.__version__
"""
    assert private_uses(source) == {
        "imports vllm.model_executor.models.adapters._load_st_projector",
        "overrides _update_after_schedule",
        "reaches Scheduler._update_after_schedule",
        "reaches .max_num_active_reqs",
        "reaches torch._C",
        "reaches ._get_privateuse1_backend_name",
        "assigns torch.accelerator.synchronize",
        "names '_actions'",
    }


def test_private_vllm_torch_argparse_names_are_reached_only_in_compat() -> None:
    found = {name: uses for name, path in vllm_modules().items() if (uses := private_uses(path.read_text()))}
    unexpected = {name: sorted(uses) for name, uses in found.items()}
    assert not unexpected, (
        f"private vLLM/torch/argparse names outside qaic_vllm.compat (add a seam): {unexpected}"
    )


MAX_MODULE_LINES = 500


def test_no_qaic_vllm_module_is_too_long() -> None:
    """Each module has one role; a module past the limit is split by role (runner/, worker/, compat/)."""
    source = ROOT / "packages" / "qaic-vllm" / "src"
    long = {
        str(path.relative_to(source)): n
        for path in sorted(source.rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"qaic-vllm modules over {MAX_MODULE_LINES} lines: {long}"
