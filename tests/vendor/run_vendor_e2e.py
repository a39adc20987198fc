"""Run vllm-qaic's own end-to-end tests against this plugin on the simulator, their code unchanged.

Their tests are exported from a local clone or mirror of github.com/qualcomm/vllm-qaic (no network is
needed or used) into a scratch folder; ``vendor_conftest.py`` goes to its root as ``conftest.py`` and
swaps their model name for a small local model, built here with random weights. See README.md.

    python tests/vendor/run_vendor_e2e.py --repo /path/to/vllm-qaic [--ref v0.23.0] [TESTS] [-- PYTEST ARGS]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
TESTS = (
    "tests/e2e/test_qaic_generate.py",
    "tests/e2e/test_qaic_samplers.py",
    "tests/e2e/test_qaic_offline_stability.py",
    "tests/e2e/test_qaic_output_consistency.py",
    "tests/e2e/test_api_server.py",
    "tests/e2e/test_openai_multi_client.py",
)
"""The vendor's end-to-end tests that need no feature this plugin lacks."""
MODEL_CONFIG = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
}
"""A small Llama: 32-wide heads, room for their 512-token context."""
DEFAULT_REPO = os.environ.get("QAIC_VENDOR_REPO", "/work/.mirror/qualcomm+vllm-qaic/repo")


def export_tests(repo: Path, ref: str, into: Path) -> None:
    """``tests/`` and ``pyproject.toml`` (their pytest markers) of ``ref``, as files under ``into``."""
    archive = subprocess.run(
        ["git", "-C", str(repo), "archive", "--format=tar", ref, "tests", "pyproject.toml"],
        check=True,
        capture_output=True,
    )
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)


def build_model(root: Path) -> Path:
    from qaic_vllm.default_model import build_model as build

    path = root / "tiny-llama-vendor-e2e"
    if not (path / "config.json").exists():
        build(path, seed=7, **MODEL_CONFIG)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repo", default=DEFAULT_REPO, help="a clone or mirror of qualcomm/vllm-qaic")
    parser.add_argument("--ref", default="HEAD", help="the revision whose tests run (default HEAD)")
    parser.add_argument("--workdir", help="where to export them (default: a temporary folder)")
    parser.add_argument("--model", help="a local model to use instead of the built tiny one")
    parser.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "qaic-vendor-e2e"))
    parser.add_argument("tests", nargs="*", help="test files or node ids (default: the six that apply)")
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)

    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="vllm-qaic-tests-"))
    if work.exists() and any(work.iterdir()):
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    export_tests(Path(args.repo), args.ref, work)
    shutil.copyfile(HERE / "vendor_conftest.py", work / "conftest.py")
    model = Path(args.model) if args.model else build_model(cache)

    env = {
        **os.environ,
        "QAIC_BACKEND": os.environ.get("QAIC_BACKEND", "sim"),
        "QAIC_STRICT_PLUGINS": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "QEFF_HOME": str(cache / "qeff"),
        "QAIC_VENDOR_MODEL": str(model),
        "QAIC_VENDOR_SHAREGPT": str(HERE / "data" / "sharegpt_small.json"),
        # Their server tests start `vllm serve` and `python3 -m vllm...`: this interpreter's.
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "--rootdir",
        str(work),
        "-c",
        str(work / "pyproject.toml"),
        "-rA",
        *(args.tests or TESTS),
        *extra,
    ]
    print(f"vllm-qaic tests exported from {args.repo} ({args.ref}) to {work}; model {model}", flush=True)
    return subprocess.run(command, cwd=work, env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
