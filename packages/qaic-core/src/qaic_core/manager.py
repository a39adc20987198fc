"""The plugin manager: discovery, isolation of broken plugins, and selection by name."""

from __future__ import annotations

import importlib.metadata as md
import logging
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

import pluggy

from qaic_core import env, hookspecs
from qaic_core.descriptors import AttentionBackend, DeviceBackend, ModelLoader, SessionBackend
from qaic_core.errors import QaicBackendNotFoundError, QaicPluginError

log = logging.getLogger("qaic.plugins")

ENTRY_POINT_GROUP = "qaic"

KNOWN_BACKENDS: dict[str, str] = {
    "qaicrt": "the Cloud AI Platform SDK (its Python module 'qaicrt'); the backend itself ships in qaic-core",
    "sim": "pip install qaic-sim",
}
"""Where each backend this project knows of comes from, for 'not installed' messages."""

D = TypeVar("D", DeviceBackend, SessionBackend, AttentionBackend, ModelLoader)


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

    def session_backends(self) -> dict[str, SessionBackend]:
        return self._collect("qaic_session_backends")

    def attention_backends(self) -> dict[str, AttentionBackend]:
        return self._collect("qaic_attention_backends")

    def model_loaders(self) -> dict[str, ModelLoader]:
        return self._collect("qaic_model_loaders")

    def available_device_backends(self) -> list[DeviceBackend]:
        """Available backends, best first (priority, then name for a stable order)."""
        backends = [b for b in self.device_backends().values() if _safe_available(b)]
        return sorted(backends, key=lambda b: (-b.priority, b.name))

    def select_device_backend(self, name: str | None = None) -> DeviceBackend:
        """The backend named by ``name``, else ``QAIC_BACKEND``, else the best available one."""
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
    try:
        return bool(backend.is_available())
    except Exception as exc:
        log.warning("qaic backend %r availability check failed: %s", backend.name, exc)
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


def get_plugin_manager(*, strict: bool | None = None, entry_points: bool = True) -> QaicPluginManager:
    """A fresh manager with the built-in backend and (by default) every installed plugin."""
    pm = QaicPluginManager(strict=strict)
    pm.load_builtin()
    if entry_points:
        pm.load_entry_points()
    return pm
