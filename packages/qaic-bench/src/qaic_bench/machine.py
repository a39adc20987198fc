"""The machine and the source revision a report was measured on, so figures can be compared."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

from qaic_core.host import usable_cpus


def _cpuinfo_field(name: str, text: str | None = None) -> str | None:
    """The first ``name: value`` of ``/proc/cpuinfo`` (or of ``text``); None where it is missing."""
    if text is None:
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    for line in text.splitlines():
        if line.lower().startswith(name):
            return line.split(":", 1)[1].strip()
    return None


def _cpu_name() -> str:
    return _cpuinfo_field("model name") or platform.processor() or platform.machine()


MATMUL_ISA = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16", "amx_int8")
"""CPU features that decide how fast matrix multiplies run: onnxruntime's float32 kernels use AVX2 or
AVX-512; a bfloat16 engine such as vLLM's CPU backend is several times faster with AMX."""


def matmul_isa(cpuinfo: str | None = None) -> str:
    """The ``MATMUL_ISA`` features among the CPU's flags (of ``cpuinfo``, default ``/proc/cpuinfo``),
    ``none of ...`` when it has none of them, ``unknown`` when no flags line can be read."""
    flags = _cpuinfo_field("flags", cpuinfo)
    if flags is None:
        return "unknown"
    have = set(flags.split())
    return " ".join(f for f in MATMUL_ISA if f in have) or "none of " + ", ".join(MATMUL_ISA)


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _memory_gib() -> float:
    try:
        import psutil

        return round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)


def machine_info() -> dict[str, Any]:
    """CPU, its matrix-multiply features, usable cores, memory (GiB) and the versions that shape the figures."""
    cores = usable_cpus()
    return {
        "cpu": _cpu_name(),
        "matmul_isa": matmul_isa(),
        "cores": cores,
        "memory": f"{_memory_gib()} GiB",
        "python": platform.python_version(),
        "torch": _version("torch"),
        "vllm": _version("vllm"),
    }


def git_commit(root: Path | None = None) -> tuple[str, bool]:
    """The checked-out commit sha and whether tracked files differ from it; ``unknown`` outside git."""
    cwd = root or Path(__file__).resolve().parent
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=cwd,
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown", False
    return sha, bool(dirty)
