"""The table of private seams: what each reaches, the version it was checked with, and its probe."""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import platform
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from qaic_core.errors import QaicError

VLLM_CHECKED = "vllm 0.34.0"
TORCH_CHECKED = "torch 2.13.0"
ARGPARSE_CHECKED = "Python 3.11 argparse"

Check = Callable[[Any], "str | None"]
"""What is wrong with a seam's target, or None when the seam holds."""


class SeamMovedError(QaicError, RuntimeError):
    """An installed release no longer has a private name a seam reaches, in the shape it was checked with."""

    def __init__(self, seam: Seam, problem: str) -> None:
        self.seam = seam
        self.problem = problem
        super().__init__(
            f"qaic-vllm's seam {seam.name!r} ({seam.reaches}) was checked with {seam.checked_with}, and the "
            f"installed {_installed(seam.checked_with)}: {problem}. Install {seam.checked_with} (the version "
            f"qaic is tested with) or update the seam {seam.name!r} in qaic_vllm.compat for this release"
        )


@dataclass(frozen=True)
class Seam:
    """One private name of vLLM, torch or argparse that qaic-vllm relies on, reached through qaic_vllm.compat."""

    name: str
    reaches: str
    checked_with: str
    load: Callable[[], Any]
    """The object the seam reaches in the installed release (imported when probed)."""
    check: Check

    def probe(self, target: Any = None) -> None:
        """Raise :class:`SeamMovedError` unless the seam holds on ``target`` (default: the installed one)."""
        if target is None:
            try:
                target = self.load()
            except (ImportError, AttributeError) as exc:
                raise SeamMovedError(self, f"cannot be loaded ({exc})") from exc
        problem = self.check(target)
        if problem is not None:
            raise SeamMovedError(self, problem)


def _installed(checked_with: str) -> str:
    name = checked_with.split()[0]
    if name == "Python":
        return f"Python {platform.python_version()}"
    try:
        return f"{name} {importlib.metadata.version(name)}"
    except importlib.metadata.PackageNotFoundError:
        return f"{name} (no version found)"


def _member(target: Any, dotted: str) -> Any:
    return functools.reduce(lambda obj, part: getattr(obj, part, None), dotted.split("."), target)


def callable_with(name: str, *params: str) -> Check:
    """``name`` (dotted) is callable and its parameters start with ``params``."""

    def check(target: Any) -> str | None:
        member = _member(target, name)
        if not callable(member):
            return f"has no {name}"
        try:
            found = list(inspect.signature(member).parameters)
        except (TypeError, ValueError):  # a builtin without a signature: callable is all there is to check
            return None
        if found[: len(params)] != list(params):
            return f"{name} takes ({', '.join(found)}), not ({', '.join(params)}, ...)"
        return None

    return check


def uses(method: str, *names: str) -> Check:
    """``method``'s source reads ``self.<name>`` for each name: the seam relies on that method using it.

    A release installed without sources is checked by the other checks only.
    """

    def check(target: Any) -> str | None:
        member = getattr(target, method, None)
        if member is None:
            return f"has no {method}"
        try:
            source = inspect.getsource(member)
        except (OSError, TypeError):
            return None
        missing = [f"self.{name}" for name in names if f"self.{name}" not in source]
        return f"{method} no longer uses {', '.join(missing)}" if missing else None

    return check


def list_attribute(name: str) -> Check:
    """``name`` is a list on the target."""

    def check(target: Any) -> str | None:
        return None if isinstance(getattr(target, name, None), list) else f"has no list {name}"

    return check


def every(*checks: Check) -> Check:
    """The first problem any of ``checks`` finds."""

    def check(target: Any) -> str | None:
        return next((p for p in (c(target) for c in checks) if p is not None), None)

    return check


def _load(module: str, name: str | None = None) -> Callable[[], Any]:
    def load() -> Any:
        loaded = importlib.import_module(module)
        return loaded if name is None else getattr(loaded, name)

    return load


def _parser() -> Any:
    import argparse

    return argparse.ArgumentParser(add_help=False)


_SCHEDULER = _load("vllm.v1.core.sched.scheduler", "Scheduler")

SEAMS: dict[str, Seam] = {
    seam.name: seam
    for seam in (
        Seam(
            "scheduler.step_limits",
            "Scheduler.max_num_active_reqs / max_num_scheduled_tokens, read by schedule() (compat.scheduler.step_limits)",
            VLLM_CHECKED,
            _SCHEDULER,
            every(
                uses("__init__", "max_num_active_reqs", "max_num_scheduled_tokens"),
                uses("schedule", "max_num_active_reqs", "max_num_scheduled_tokens"),
            ),
        ),
        Seam(
            "scheduler.step_update",
            "Scheduler._update_after_schedule, called by schedule() (compat.scheduler.ModeMatchedScheduler)",
            VLLM_CHECKED,
            _SCHEDULER,
            every(
                callable_with("_update_after_schedule", "self", "scheduler_output"),
                uses("schedule", "_update_after_schedule"),
            ),
        ),
        Seam(
            "scheduler.preempt",
            "Scheduler._preempt_request(request, timestamp) (compat.scheduler.preempt)",
            VLLM_CHECKED,
            _SCHEDULER,
            callable_with("_preempt_request", "self", "request", "timestamp"),
        ),
        Seam(
            "scheduler.fail_request",
            "Scheduler.grammar_compile_error_reqs, finished with their error by update_from_output() "
            "(compat.scheduler.fail_request)",
            VLLM_CHECKED,
            _SCHEDULER,
            every(
                uses("__init__", "grammar_compile_error_reqs"),
                uses("update_from_output", "grammar_compile_error_reqs"),
            ),
        ),
        Seam(
            "engine_args.batch_defaults",
            "EngineArgs._set_default_max_num_seqs_and_batched_tokens_args, called by create_engine_config() "
            "(compat.engine_args.install_batch_default_probe)",
            VLLM_CHECKED,
            _load("vllm.engine.arg_utils", "EngineArgs"),
            every(
                callable_with(
                    "_set_default_max_num_seqs_and_batched_tokens_args",
                    "self",
                    "usage_context",
                    "model_config",
                ),
                uses("create_engine_config", "_set_default_max_num_seqs_and_batched_tokens_args"),
            ),
        ),
        Seam(
            "models.st_projector",
            "vllm.model_executor.models.adapters._load_st_projector(model_config) (compat.models.load_st_projector)",
            VLLM_CHECKED,
            _load("vllm.model_executor.models.adapters"),
            callable_with("_load_st_projector", "model_config"),
        ),
        Seam(
            "argparse.actions",
            "ArgumentParser._actions, to widen --kv-cache-dtype (compat.arguments.accept_kv_cache_dtype)",
            ARGPARSE_CHECKED,
            _parser,
            list_attribute("_actions"),
        ),
        Seam(
            "torch.accelerator",
            "torch.accelerator.empty_cache / synchronize made no-ops on CPU-only torch "
            "(compat.torch_device.neutralise_accelerator)",
            TORCH_CHECKED,
            _load("torch", "accelerator"),
            every(callable_with("is_available"), callable_with("empty_cache"), callable_with("synchronize")),
        ),
        Seam(
            "torch.privateuse1",
            "torch._C._get_privateuse1_backend_name and torch._register_device_module "
            "(compat.torch_device.privateuse1_name / register_host_only_device)",
            TORCH_CHECKED,
            _load("torch"),
            every(
                callable_with("_C._get_privateuse1_backend_name"),
                callable_with("_register_device_module", "device_type", "module"),
            ),
        ),
    )
}
"""Every seam by name; docs/vllm.md ("vLLM's private seams") lists the same."""


@functools.cache
def probe_all() -> None:
    """Probe every seam once per process: a release that moved one fails at start-up, naming it."""
    for seam in SEAMS.values():
        seam.probe()
