"""Environment variables of the vLLM plugin (vllm-qaic's names), registered with vLLM."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from qaic_core.env import env_flag
from qaic_core.errors import QaicConfigError

VLLM_QAIC_QPC_PATH = "VLLM_QAIC_QPC_PATH"
VLLM_QAIC_NUM_CORES = "VLLM_QAIC_NUM_CORES"
VLLM_QAIC_MOS = "VLLM_QAIC_MOS"
VLLM_QAIC_DFS_EN = "VLLM_QAIC_DFS_EN"
VLLM_QAIC_COMPILER_ARGS = "VLLM_QAIC_COMPILER_ARGS"
VLLM_QAIC_MAX_CPU_THREADS = "VLLM_QAIC_MAX_CPU_THREADS"

ENV_VARS: dict[str, str] = {
    VLLM_QAIC_QPC_PATH: "a prebuilt QPC directory to serve instead of compiling (checked against the model)",
    VLLM_QAIC_NUM_CORES: "NSP cores per SoC to compile for (1-16); override_qaic_config.num_cores wins",
    VLLM_QAIC_MOS: "compiler -mos value (>= 1); override_qaic_config.mos wins",
    VLLM_QAIC_DFS_EN: "1 to compile with -aic-enable-depth-first",
    VLLM_QAIC_COMPILER_ARGS: "extra qaic-compile arguments, space separated",
    VLLM_QAIC_MAX_CPU_THREADS: "torch threads of the worker's host work (sampling); default: torch's own",
    "VLLM_TORCH_PROFILER_DIR": "where worker.profile() writes per-iteration device traces (lrt_trace_iter{N}_pid{P})",
}
"""Every variable this plugin reads, with a one-line meaning (docs/vllm.md lists the same)."""


def _getter(name: str) -> Callable[[], Any]:
    return lambda: os.environ.get(name)


def register_with_vllm() -> None:
    """Add our variables to vLLM's table so its environment validation does not warn about them."""
    import vllm.envs as venvs

    for name in ENV_VARS:
        venvs.environment_variables.setdefault(name, _getter(name))


def overrides_from_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The compile overrides given by ``VLLM_QAIC_*`` variables, parsed with errors naming the variable."""
    env = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    for name, key in ((VLLM_QAIC_NUM_CORES, "num_cores"), (VLLM_QAIC_MOS, "mos")):
        raw = env.get(name, "").strip()
        if raw:
            try:
                out[key] = int(raw)
            except ValueError:
                raise QaicConfigError(f"{name}={raw!r} is not an integer: set it to a whole number") from None
    if env.get(VLLM_QAIC_DFS_EN, "").strip():
        out["aic_enable_depth_first"] = env_flag(VLLM_QAIC_DFS_EN, environ=env)
    raw = env.get(VLLM_QAIC_COMPILER_ARGS, "").strip()
    if raw:
        out["compiler_args"] = tuple(raw.split())
    raw = env.get(VLLM_QAIC_QPC_PATH, "").strip()
    if raw:
        out["qpc_path"] = raw
    return out


def max_cpu_threads(environ: Mapping[str, str] | None = None) -> int | None:
    """``VLLM_QAIC_MAX_CPU_THREADS`` as a positive integer, or None when unset."""
    env = os.environ if environ is None else environ
    raw = env.get(VLLM_QAIC_MAX_CPU_THREADS, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise QaicConfigError(
            f"{VLLM_QAIC_MAX_CPU_THREADS}={raw!r} is not a positive integer: give a thread count such as 1"
        )
    return int(raw)
