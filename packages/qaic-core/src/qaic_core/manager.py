"""The plugin manager: discovery, isolation of broken plugins, and selection by name."""

from __future__ import annotations

import importlib.metadata as md
import logging
import threading
from collections.abc import Callable, Collection, Iterable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

import pluggy

from qaic_core import env, hookspecs
from qaic_core.descriptors import (
    AttentionBackend,
    DeviceBackend,
    ExecutionPath,
    ModelLoader,
    SessionFactory,
)
from qaic_core.errors import QaicBackendNotFoundError, QaicConfigError, QaicPluginError
from qaic_core.execution import check_capabilities
from qaic_core.observe import Observer, Observers

if TYPE_CHECKING:
    from qaic_core.execution import ExecutionConfig

log = logging.getLogger("qaic.plugins")

ENTRY_POINT_GROUP = "qaic"

KNOWN_BACKENDS: dict[str, str] = {
    "qaicrt": "the Cloud AI Platform SDK (its Python module 'qaicrt'); the backend itself ships in qaic-core",
    "sim": "pip install qaic-sim",
}
"""Where each backend this project knows of comes from, for 'not installed' messages."""

EXECUTION_PATH_PACKAGES: dict[str, str] = {"aot": "qaic-aot", "pyt": "qaic-pyt"}
"""Which distribution provides each execution path this project knows of."""

D = TypeVar("D", DeviceBackend, ExecutionPath, AttentionBackend, ModelLoader, SessionFactory)
T = TypeVar("T")

_SKIPPED = "skipped; the other plugins keep working"


class QaicPluginManager(pluggy.PluginManager):
    """pluggy manager for the ``qaic`` project with typed, name-keyed lookups.

    Every problem with one plugin (it fails to load, implements a hook that does not exist, takes
    a name already registered, or its hook raises or returns garbage) is logged with the plugin's
    distribution and version, recorded in :attr:`load_errors` and that plugin skipped; with
    ``strict`` (``QAIC_STRICT_PLUGINS=1``) it raises :class:`QaicPluginError` instead.
    """

    def __init__(self, *, strict: bool | None = None, trace: bool | None = None) -> None:
        super().__init__("qaic")
        self.add_hookspecs(hookspecs)
        self.strict = env.strict_plugins() if strict is None else strict
        self._providers: dict[str, str] = {}
        self._entry_points: dict[str, tuple[str, str]] = {}
        self._reported: set[tuple[str, str]] = set()
        self.load_errors: dict[str, str] = {}
        """Every problem met, by plugin name (several are joined by newlines), for tools to show."""
        if env.trace_plugins() if trace is None else trace:
            self.trace.root.setwriter(_trace_to_log)
            self.enable_tracing()

    # -- registration -------------------------------------------------------------------
    def register(self, plugin: object, name: str | None = None) -> str | None:
        """pluggy's register, then a check for unknown hooks, so a misspelt hook drops only its plugin."""
        plugin_name = name or self.get_canonical_name(plugin)
        try:
            registered = super().register(plugin, name)
        except pluggy.PluginValidationError as exc:  # a hook whose arguments differ from its spec
            self._fail(plugin_name, "register", f"{self._whom(plugin_name, plugin)} is invalid: {exc}", exc)
            return None
        if registered is None:
            return None
        unknown = self._unknown_hooks(plugin)
        if unknown:
            self.unregister(plugin)
            known = ", ".join(sorted(n for n in dir(hookspecs) if n.startswith("qaic_")))
            self._fail(
                registered,
                "register",
                f"{self._whom(registered, plugin)} implements unknown hook(s) {', '.join(unknown)} "
                f"(a misspelt name? the hooks are {known})",
            )
            return None
        return registered

    def register_plugin(self, plugin: object, name: str, provider: str) -> str | None:
        """Register ``plugin`` under ``name``; ``provider`` (distribution and version) names it in errors.

        Returns the name, or None when the plugin was rejected (see :meth:`register`).
        """
        if self.has_plugin(name):
            raise ValueError(f"qaic plugin name {name!r} is already registered by {self._provider(name)}")
        self._providers[name] = provider
        try:
            registered = self.register(plugin, name=name)
        except BaseException:
            self._providers.pop(name, None)
            raise
        if registered is None:
            self._providers.pop(name, None)
        return registered

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
                if self._entry_points.get(ep.name) == (provider, ep.value):
                    continue  # the same entry point, loaded again
                self._fail(
                    ep.name,
                    f"duplicate {provider} {ep.value}",
                    f"qaic plugin {ep.name!r} from {provider} ({ep.value}): the name {ep.name!r} is "
                    f"already registered by {self._provider(ep.name)}; uninstall or rename one of them",
                )
                continue
            try:
                plugin = ep.load()
            except Exception as exc:
                message = (
                    f"qaic plugin {ep.name!r} from {provider} failed to load: {type(exc).__name__}: {exc}"
                )
                self._fail(ep.name, "load", message, exc)
                continue
            if self.register_plugin(plugin, ep.name, provider) is not None:
                self._entry_points[ep.name] = (provider, ep.value)

    # -- problems -----------------------------------------------------------------------
    def _provider(self, name: str, plugin: object = None) -> str:
        """Distribution and version of plugin ``name``, as registered or found from its module."""
        if name in self._providers:
            return self._providers[name]
        plugin = self.get_plugin(name) if plugin is None else plugin
        return _provider_of(plugin) if plugin is not None else "an unknown distribution"

    def _whom(self, name: str, plugin: object = None) -> str:
        return f"qaic plugin {name!r} from {self._provider(name, plugin)}"

    def _fail(self, name: str, key: str, message: str, exc: BaseException | None = None) -> None:
        """Record a problem of plugin ``name``; raise when strict, else log it once per ``key``."""
        recorded = self.load_errors.get(name)
        if recorded is None:
            self.load_errors[name] = message
        elif message not in recorded.split("\n"):
            self.load_errors[name] = f"{recorded}\n{message}"
        if self.strict:
            raise QaicPluginError(f"{message} ({env.QAIC_STRICT_PLUGINS} is set)") from exc
        if (name, key) not in self._reported:
            self._reported.add((name, key))
            log.error("%s; %s", message, _SKIPPED)

    def _unknown_hooks(self, plugin: object) -> list[str]:
        """Hooks ``plugin`` implements that have no spec (pluggy's ``check_pending`` rule)."""
        return sorted(
            caller.name
            for caller in self.get_hookcallers(plugin) or ()
            if not caller.has_spec()
            and any(i.plugin is plugin and not i.optionalhook for i in caller.get_hookimpls())
        )

    # -- lookups ------------------------------------------------------------------------
    def _call_each(self, hook_name: str, kind: type[T], named: bool) -> list[tuple[str, list[T]]]:
        """Call ``hook_name`` through pluggy once per plugin, the others left out, checking each result.

        A plugin whose hook raises or returns anything but a sequence of ``kind`` (with a non-empty
        ``name`` when ``named``) is reported and left out; the rest are returned by plugin name.
        """
        caller: pluggy.HookCaller = getattr(self.hook, hook_name)
        plugins: dict[str, object] = {}
        for impl in caller.get_hookimpls():
            if not (impl.wrapper or impl.hookwrapper):
                plugins.setdefault(impl.plugin_name, impl.plugin)
        found: list[tuple[str, list[T]]] = []
        for name, plugin in plugins.items():
            self.trace(hook_name, "on plugin", name)
            alone = self.subset_hook_caller(hook_name, [p for p in plugins.values() if p is not plugin])
            try:
                results = alone()
            except Exception as exc:
                message = f"{self._whom(name)}: hook {hook_name} raised {type(exc).__name__}: {exc}"
                self._fail(name, hook_name, message, exc)
                continue
            items: list[T] = []
            problem = None
            for result in results:
                problem = _invalid(result, kind, named)
                if problem is not None:
                    break
                items.extend(result)
            if problem is not None:
                self._fail(name, hook_name, f"{self._whom(name)}: hook {hook_name} returned {problem}")
                continue
            found.append((name, items))
        return found

    def _collect(self, hook_name: str, kind: type[D]) -> dict[str, D]:
        found: dict[str, tuple[D, str]] = {}
        for plugin_name, items in self._call_each(hook_name, kind, named=True):
            provider = self._provider(plugin_name)
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
        return self._collect("qaic_device_backends", DeviceBackend)

    def execution_paths(self) -> dict[str, ExecutionPath]:
        """Every registered execution path by name; a capability name no runner knows is refused (a typo)."""
        paths = self._collect("qaic_execution_paths", ExecutionPath)
        for name, path in paths.items():
            check_capabilities(path.capabilities, f"execution path {name!r} ({path.package})")
        return paths

    def attention_backends(self) -> dict[str, AttentionBackend]:
        """Every registered attention backend of the eager path by name."""
        return self._collect("qaic_attention_backends", AttentionBackend)

    def model_loaders(self) -> dict[str, ModelLoader]:
        """Every registered model loader by name."""
        return self._collect("qaic_model_loaders", ModelLoader)

    def session_factories(self) -> dict[str, SessionFactory]:
        """Every registered session factory by name, available or not."""
        return self._collect("qaic_session_factories", SessionFactory)

    def select_model_loader(self, config: ExecutionConfig, kinds: Collection[str], path: str) -> ModelLoader:
        """The loader ``path`` opens ``config`` with: named by ``config.loader``, else ``QAIC_MODEL_LOADER``,
        else the applicable loader of ``kinds`` with the highest priority (then the first name)."""
        loaders = self.model_loaders()
        fitting = {name: loader for name, loader in loaders.items() if loader.kind in kinds}
        listed = ", ".join(f"{name} ({loader.kind})" for name, loader in sorted(fitting.items())) or "none"
        wanted = config.loader or env.requested_model_loader()
        if wanted is None:
            applicable = [loader for loader in fitting.values() if _safe_applies(loader, config)]
            if not applicable:
                raise QaicBackendNotFoundError(
                    f"no model loader of the {path} execution path applies to {config.model_dir}; its "
                    f"loaders: {listed}; name one with {env.QAIC_MODEL_LOADER}"
                )
            return min(applicable, key=lambda loader: (-loader.priority, loader.name))
        source = "ExecutionConfig.loader" if config.loader else env.QAIC_MODEL_LOADER
        if wanted not in loaders:
            raise QaicBackendNotFoundError(
                f"unknown qaic model loader {wanted!r} (from {source}); the {path} execution path's "
                f"loaders: {listed}"
            )
        loader = loaders[wanted]
        if loader.kind not in kinds:
            raise QaicConfigError(
                f"model loader {wanted!r} (from {source}, {loader.package}) loads {loader.kind}, which the "
                f"{path} execution path does not run ({', '.join(sorted(kinds))}): name one of {listed}"
            )
        if not loader.applies(config):
            raise QaicConfigError(
                f"model loader {wanted!r} (from {source}, {loader.package}) cannot load {config.model_dir} "
                f"as configured ({loader.description or loader.kind}); name another of {listed}"
            )
        return loader

    def select_session_factory(self, name: str | None = None) -> SessionFactory:
        """The factory named by ``name`` (``ExecutionConfig.session``), else ``QAIC_SESSION_FACTORY``,
        else the available one with the highest priority (then the first name)."""
        factories = self.session_factories()
        listed = ", ".join(sorted(factories)) or "none (pip install qaic-aot)"
        wanted = name or env.requested_session_factory()
        if wanted is None:
            available = [
                f for f in factories.values() if _safe_call(f.is_available, f"session factory {f.name!r}")
            ]
            if not available:
                raise QaicBackendNotFoundError(f"no qaic session factory is available; installed: {listed}")
            return min(available, key=lambda f: (-f.priority, f.name))
        source = "ExecutionConfig.session" if name else env.QAIC_SESSION_FACTORY
        if wanted not in factories:
            raise QaicBackendNotFoundError(
                f"unknown qaic session factory {wanted!r} (from {source}); installed: {listed}"
            )
        factory = factories[wanted]
        _require_available("session factory", wanted, factory, f"installed: {listed}")
        return factory

    def observers(self) -> Observers:
        """Every registered observer behind one (empty, and false, when there is none)."""
        found: list[Observer] = []
        for _name, items in self._call_each("qaic_observers", Observer, named=False):
            found.extend(items)
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
        _require_available("execution path", name, path, f"installed paths: {installed}")
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


def _invalid(result: object, kind: type, named: bool) -> str | None:
    """Why one hook result is not a sequence of ``kind`` (named ones when ``named``); None when it is."""
    if isinstance(result, str | bytes) or not isinstance(result, Sequence):
        return f"{_short(result)}, not a list of {kind.__name__}"
    for item in result:
        if not isinstance(item, kind):
            return f"{_short(item)} in its list, not a {kind.__name__}"
        name = getattr(item, "name", None)
        if named and not (isinstance(name, str) and name.strip()):
            return f"a {kind.__name__} without a name ({name!r})"
    return None


def _short(value: object) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:80]}{'...' if len(text) > 80 else ''}"


def _trace_to_log(text: str) -> None:
    """pluggy's trace writer: each line of a hook trace goes to the ``qaic.plugins`` log at DEBUG."""
    for line in text.splitlines():
        if line.strip():
            log.debug("trace %s", line.rstrip())


def _provider_of(plugin: object) -> str:
    """``DIST VERSION`` of the distribution holding ``plugin``'s module, else the module's name."""
    module = plugin.__name__ if isinstance(plugin, ModuleType) else type(plugin).__module__
    dists = md.packages_distributions().get(module.split(".")[0], [])
    return f"{dists[0]} {_version(dists[0])}" if dists else f"module {module}"


def _version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "(not installed)"


def _safe_available(backend: DeviceBackend) -> bool:
    return _safe_call(backend.is_available, f"backend {backend.name!r}")


def _safe_applies(loader: ModelLoader, config: ExecutionConfig) -> bool:
    try:
        return bool(loader.applies(config))
    except Exception as exc:
        log.warning("qaic model loader %r: applies() failed: %s", loader.name, exc)
        return False


def _require_available(what: str, name: str, item: ExecutionPath | SessionFactory, installed: str) -> None:
    """Refuse an installed ``item`` that cannot run here, saying why (its description) and what else is installed."""
    if not _safe_call(item.is_available, f"{what} {name!r}"):
        raise QaicBackendNotFoundError(
            f"qaic {what} {name!r} ({item.package}) is installed but cannot run here: "
            f"{item.description or 'its requirements are missing'}; {installed}"
        )


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
