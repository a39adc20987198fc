"""Environment variables of the vLLM plugin (vllm-qaic's names), registered with vLLM."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from qaic_core.errors import QaicConfigError
from qaic_core.settings import SETTINGS

VLLM_QAIC_QPC_PATH = "VLLM_QAIC_QPC_PATH"
VLLM_QAIC_NUM_CORES = "VLLM_QAIC_NUM_CORES"
VLLM_QAIC_MOS = "VLLM_QAIC_MOS"
VLLM_QAIC_DFS_EN = "VLLM_QAIC_DFS_EN"
VLLM_QAIC_COMPILER_ARGS = "VLLM_QAIC_COMPILER_ARGS"
VLLM_QAIC_MAX_CPU_THREADS = "VLLM_QAIC_MAX_CPU_THREADS"
VLLM_QAIC_FAULT_POLICY = "VLLM_QAIC_FAULT_POLICY"
VLLM_QAIC_MAX_DEVICE_FAULTS = "VLLM_QAIC_MAX_DEVICE_FAULTS"
VLLM_QAIC_EXECUTION_MODE = "VLLM_QAIC_EXECUTION_MODE"

ENV_SETTINGS: dict[str, str] = {
    VLLM_QAIC_NUM_CORES: "num_cores",
    VLLM_QAIC_MOS: "mos",
    VLLM_QAIC_DFS_EN: "aic_enable_depth_first",
    VLLM_QAIC_COMPILER_ARGS: "compiler_args",
}
"""vllm-qaic's variable for a compile setting, parsed by that setting's entry in qaic_core.settings."""

ENV_VARS: dict[str, str] = {
    VLLM_QAIC_QPC_PATH: "a prebuilt QPC directory to serve instead of compiling (checked against the model)",
    **{var: f"{SETTINGS[name].help}; override_qaic_config.{name} wins" for var, name in ENV_SETTINGS.items()},
    VLLM_QAIC_MAX_CPU_THREADS: "torch threads of the worker's host work (sampling); default: torch's own",
    "VLLM_TORCH_PROFILER_DIR": "where worker.profile() writes per-iteration device traces (lrt_trace_iter{N}_pid{P})",
    VLLM_QAIC_FAULT_POLICY: "after a device fault: `fail` the requests that held KV (default) or `recompute` them",
    VLLM_QAIC_MAX_DEVICE_FAULTS: "device faults tolerated within 600 s before the server stops with status 1 (default 3)",
    VLLM_QAIC_EXECUTION_MODE: "`aot` (compiled programs) or `pyt` (eager); default: `pyt` when torch_qaic imports, else `aot`",
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
    for var, name in ENV_SETTINGS.items():
        raw = env.get(var, "").strip()
        if raw:
            out[name] = SETTINGS[name].parse(raw, var)
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
