"""The plugin manager: discovery, isolation of broken plugins, and selection by name."""

from __future__ import annotations

import importlib.metadata as md
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import pluggy

from qaic_core import env, hookspecs
from qaic_core.descriptors import AttentionBackend, DeviceBackend, ExecutionPath
from qaic_core.errors import QaicBackendNotFoundError, QaicPluginError
from qaic_core.observe import Observer, Observers

log = logging.getLogger("qaic.plugins")

ENTRY_POINT_GROUP = "qaic"

KNOWN_BACKENDS: dict[str, str] = {
    "qaicrt": "the Cloud AI Platform SDK (its Python module 'qaicrt'); the backend itself ships in qaic-core",
    "sim": "pip install qaic-sim",
}
"""Where each backend this project knows of comes from, for 'not installed' messages."""

EXECUTION_PATH_PACKAGES: dict[str, str] = {"aot": "qaic-aot", "pyt": "qaic-pyt"}
"""Which distribution provides each execution path this project knows of."""

D = TypeVar("D", DeviceBackend, ExecutionPath, AttentionBackend)


class QaicPluginManager(pluggy.PluginManager):
    """pluggy manager for the ``qaic`` project with typed, name-keyed lookups."""

    def __init__(self, *, strict: bool | None = None) -> None:
        super().__init__("qaic")
        self.add_hookspecs(hookspecs)
        self.strict = env.strict_plugins() if strict is None else strict
        self._providers: dict[str, str] = {}
        self.load_errors: dict[str, str] = {}

    # -- registration -------------------------------------------------------------------
    def register_plugin(self, plugin: object, name: str, provider: str) -> None:
        """Register ``plugin`` under ``name``; ``provider`` names its distribution for errors."""
        self.register(plugin, name=name)
        self._providers[name] = provider

    def load_builtin(self) -> None:
        """Register the backends that ship inside qaic-core (the real ``qaicrt`` backend)."""
        from qaic_core.backends import qaicrt_backend

        if not self.is_registered(qaicrt_backend):
            self.register_plugin(qaicrt_backend, "qaicrt", f"qaic-core {_version('qaic-core')}")

    def load_entry_points(self, entry_points: Iterable[md.EntryPoint] | None = None) -> None:
        """Load every ``qaic`` entry point, each on its own: one broken plugin cannot stop the rest."""
        eps = md.entry_points(group=ENTRY_POINT_GROUP) if entry_points is None else entry_points
        for ep in eps:
            dist = getattr(ep, "dist", None)
            provider = f"{dist.name} {dist.version}" if dist is not None else f"entry point {ep.value}"
            if self.has_plugin(ep.name):
                continue
            try:
                plugin = ep.load()
                self.register_plugin(plugin, ep.name, provider)
            except Exception as exc:
                message = (
                    f"qaic plugin {ep.name!r} from {provider} failed to load: {type(exc).__name__}: {exc}"
                )
                self.load_errors[ep.name] = message
                if self.strict:
                    raise QaicPluginError(message + f" ({env.QAIC_STRICT_PLUGINS} is set)") from exc
                log.error("%s; the other plugins keep working", message)
        self.check_pending()

    # -- lookups ------------------------------------------------------------------------
    def _collect(self, hook_name: str) -> dict[str, D]:
        found: dict[str, tuple[D, str]] = {}
        caller = getattr(self.hook, hook_name)
        for impl in caller.get_hookimpls():
            provider = self._providers.get(impl.plugin_name, impl.plugin_name)
            items: Sequence[D] = impl.function() or ()
            for item in items:
                if item.name in found:
                    other = found[item.name][1]
                    raise QaicPluginError(
                        f"two plugins register the {hook_name.removeprefix('qaic_')} name "
                        f"{item.name!r}: {other} and {provider}; uninstall one of them"
                    )
                found[item.name] = (item, provider)
        return {name: pair[0] for name, pair in found.items()}

    def device_backends(self) -> dict[str, DeviceBackend]:
        """Every registered device backend by name, available or not."""
        return self._collect("qaic_device_backends")

    def execution_paths(self) -> dict[str, ExecutionPath]:
        """Every registered execution path by name."""
        return self._collect("qaic_execution_paths")

    def attention_backends(self) -> dict[str, AttentionBackend]:
        return self._collect("qaic_attention_backends")

    def observers(self) -> Observers:
        """Every registered observer behind one (empty, and false, when there is none)."""
        found: list[Observer] = []
        for items in self.hook.qaic_observers():
            found.extend(items or ())
        return Observers(found)

    def select_execution_path(self, name: str) -> ExecutionPath:
        """The execution path called ``name``; an unknown or unavailable one names the installed paths."""
        paths = self.execution_paths()
        installed = ", ".join(sorted(paths)) or "none"
        if name not in paths:
            hint = EXECUTION_PATH_PACKAGES.get(name)
            raise QaicBackendNotFoundError(
                f"unknown qaic execution path {name!r}; installed paths: {installed}"
                + (f"; to get it: pip install {hint}" if hint else "")
            )
        path = paths[name]
        if not _safe_call(path.is_available, f"execution path {name!r}"):
            raise QaicBackendNotFoundError(
                f"qaic execution path {name!r} ({path.package}) is installed but cannot run here: "
                f"{path.description or 'its requirements are missing'}; installed paths: {installed}"
            )
        return path

    def available_device_backends(self) -> list[DeviceBackend]:
        """Available backends, best first (priority, then name for a stable order)."""
        backends = [b for b in self.device_backends().values() if _safe_available(b)]
        return sorted(backends, key=lambda b: (-b.priority, b.name))

    def select_device_backend(self, name: str | DeviceBackend | None = None) -> DeviceBackend:
        """The backend named by ``name``, else ``QAIC_BACKEND``, else the best available one.

        A descriptor already selected is returned as it is, so a selection travels between
        packages as the descriptor and is never made twice.
        """
        if isinstance(name, DeviceBackend):
            return name
        wanted = name or env.requested_backend()
        backends = self.device_backends()
        if wanted is None:
            available = self.available_device_backends()
            if not available:
                raise QaicBackendNotFoundError(
                    "no qaic device backend is available; " + _install_hint(backends)
                )
            return available[0]
        if wanted not in backends:
            raise QaicBackendNotFoundError(
                f"unknown qaic backend {wanted!r} (from {'argument' if name else env.QAIC_BACKEND}); "
                + _install_hint(backends)
            )
        backend = backends[wanted]
        if not _safe_available(backend):
            raise QaicBackendNotFoundError(
                f"qaic backend {wanted!r} is installed but not available on this machine "
                f"({backend.description or backend.package}); " + _install_hint(backends)
            )
        return backend


def _version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "(not installed)"


def _safe_available(backend: DeviceBackend) -> bool:
    return _safe_call(backend.is_available, f"backend {backend.name!r}")


def _safe_call(is_available: Callable[[], bool], what: str) -> bool:
    try:
        return bool(is_available())
    except Exception as exc:
        log.warning("qaic %s availability check failed: %s", what, exc)
        return False


def _install_hint(backends: dict[str, Any]) -> str:
    installed = ", ".join(
        f"{name} ({'available' if _safe_available(b) else 'not available'})"
        for name, b in sorted(backends.items())
    )
    missing = [f"{name}: {how}" for name, how in KNOWN_BACKENDS.items() if name not in backends]
    text = f"installed backends: {installed or 'none'}"
    hints = [f"{name}: {how}" for name, how in KNOWN_BACKENDS.items()]
    text += "; to get a backend: " + "; ".join(missing or hints)
    return text


_PROCESS_MANAGER: QaicPluginManager | None = None
_PROCESS_LOCK = threading.Lock()


def new_plugin_manager(*, strict: bool | None = None, entry_points: bool = True) -> QaicPluginManager:
    """A fresh manager with the built-in backend and (by default) every installed plugin."""
    pm = QaicPluginManager(strict=strict)
    pm.load_builtin()
    if entry_points:
        pm.load_entry_points()
    return pm


def get_plugin_manager(*, strict: bool | None = None, entry_points: bool = True) -> QaicPluginManager:
    """The process's manager, built on first use and then shared by every package.

    Giving ``strict`` or ``entry_points=False`` asks for a manager unlike the shared one, so a
    fresh one is built and not kept (tests use this; see also :func:`reset_plugin_manager`).
    """
    global _PROCESS_MANAGER
    if strict is not None or not entry_points:
        return new_plugin_manager(strict=strict, entry_points=entry_points)
    with _PROCESS_LOCK:
        if _PROCESS_MANAGER is None:
            _PROCESS_MANAGER = new_plugin_manager()
        return _PROCESS_MANAGER


def reset_plugin_manager(pm: QaicPluginManager | None = None) -> None:
    """Forget the shared manager (the next :func:`get_plugin_manager` builds one), or install ``pm``."""
    global _PROCESS_MANAGER
    with _PROCESS_LOCK:
        _PROCESS_MANAGER = pm
