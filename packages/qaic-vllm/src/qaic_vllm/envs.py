"""Environment variables of the vLLM plugin (vllm-qaic's names), registered with vLLM."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from qaic_core.env import parse_bool
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


# -- vllm-qaic's other variables (qaic_vllm.vendor describes each) ------------------------------------
SPEC_TARGET_VARS: dict[str, str] = {
    "VLLM_QAIC_SPEC_TARGET_QPC_PATH": "qpc_path",
    "VLLM_QAIC_SPEC_TARGET_MOS": "mos",
    "VLLM_QAIC_SPEC_TARGET_DFS_EN": "aic_enable_depth_first",
    "VLLM_QAIC_SPEC_TARGET_QID": "device_group",
    "VLLM_QAIC_SPEC_TARGET_NUM_CORES": "num_cores",
    "VLLM_QAIC_SPEC_TARGET_COMPILER_ARGS": "compiler_args",
}
"""Under ``--speculative-config``: the target program's settings (they win over the plain variables)."""
SPEC_DRAFT_VARS: dict[str, str] = {
    "VLLM_QAIC_SPEC_DRAFT_QPC_PATH": "qpc_path",
    "VLLM_QAIC_SPEC_DRAFT_MOS": "mos",
    "VLLM_QAIC_SPEC_DRAFT_DFS_EN": "aic_enable_depth_first",
    "VLLM_QAIC_SPEC_DRAFT_KV_COMPRESSION": "mxint8",
    "VLLM_QAIC_SPEC_DRAFT_QID": "device_group",
    "VLLM_QAIC_SPEC_DRAFT_NUM_CORES": "num_cores",
    "VLLM_QAIC_SPEC_DRAFT_COMPILER_ARGS": "compiler_args",
}
"""The ``draft_model`` program's settings (they win over ``draft_override_qaic_config``)."""
VLLM_QAIC_ENABLE_LRT_DEBUG = "VLLM_QAIC_ENABLE_LRT_DEBUG"
VLLM_TORCH_QAIC_PROFILER_DIR = "VLLM_TORCH_QAIC_PROFILER_DIR"


def _vendor_vars() -> dict[str, str]:
    from qaic_vllm import vendor

    return {
        name: f"vllm-qaic's {key.meaning}: {key.handling} here ({key.here})"
        for name, key in vendor.ENV_VARS.items()
    }


ENV_VARS.update({name: text for name, text in _vendor_vars().items() if name not in ENV_VARS})


def _settings_from(variables: Mapping[str, str], environ: Mapping[str, str] | None) -> dict[str, Any]:
    env = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    for var, name in variables.items():
        raw = env.get(var, "").strip()
        if raw:
            out[name] = raw if name == "qpc_path" else SETTINGS[name].parse(raw, var)
    return out


def target_overrides_from_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``VLLM_QAIC_SPEC_TARGET_*`` as settings by name (read under ``--speculative-config``)."""
    return _settings_from(SPEC_TARGET_VARS, environ)


def draft_overrides_from_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``VLLM_QAIC_SPEC_DRAFT_*`` as settings by name (read for a ``draft_model`` program)."""
    return _settings_from(SPEC_DRAFT_VARS, environ)


def no_effect_notes(environ: Mapping[str, str] | None = None) -> list[str]:
    """A line for each vllm-qaic variable that is set but does nothing here (as in vllm-qaic's AOT mode)."""
    from qaic_vllm import vendor

    env = os.environ if environ is None else environ
    return [
        f"{name} has no effect here ({key.here})"
        for name, key in vendor.ENV_VARS.items()
        if key.handling == vendor.NO_EFFECT and env.get(name, "").strip()
    ]


def lrt_debug(environ: Mapping[str, str] | None = None) -> bool:
    """``VLLM_QAIC_ENABLE_LRT_DEBUG=1``: the runtime's debug logs (the session's enable_debug_logs)."""
    env = os.environ if environ is None else environ
    raw = env.get(VLLM_QAIC_ENABLE_LRT_DEBUG, "").strip()
    return parse_bool(raw, VLLM_QAIC_ENABLE_LRT_DEBUG) if raw else False
