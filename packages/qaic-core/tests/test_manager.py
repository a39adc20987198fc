"""Plugin-manager behaviour: isolation, strictness, duplicates, selection, pending hooks."""

from __future__ import annotations

import logging
import sys
import types
from collections.abc import Iterator
from importlib.metadata import EntryPoint

import pluggy
import pytest

from qaic_core import (
    DeviceBackend,
    QaicBackendNotFoundError,
    QaicPluginError,
    QaicPluginManager,
    get_plugin_manager,
    hookimpl,
)


def _backend(name: str, *, priority: int = 0, available: bool = True) -> DeviceBackend:
    return DeviceBackend(
        name=name,
        package=f"pkg-{name}",
        runtime=lambda: types.ModuleType("rt"),
        aicapi=lambda: types.ModuleType("api"),
        is_available=lambda: available,
        priority=priority,
    )


def _plugin_module(modname: str, *backends: DeviceBackend) -> types.ModuleType:
    mod = types.ModuleType(modname)

    @hookimpl
    def qaic_device_backends() -> list[DeviceBackend]:
        return list(backends)

    mod.qaic_device_backends = qaic_device_backends  # type: ignore[attr-defined]
    return mod


@pytest.fixture
def fake_modules() -> Iterator[dict[str, types.ModuleType]]:
    """Install throwaway plugin modules in sys.modules for EntryPoint.load()."""
    mods = {
        "fake_good": _plugin_module("fake_good", _backend("good", priority=5)),
        "fake_other": _plugin_module("fake_other", _backend("other", priority=1)),
        "fake_dup": _plugin_module("fake_dup", _backend("good")),
    }
    broken = types.ModuleType("fake_broken")
    mods["fake_broken"] = broken
    sys.modules.update(mods)
    yield mods
    for name in mods:
        sys.modules.pop(name, None)


def _ep(name: str, value: str) -> EntryPoint:
    return EntryPoint(name=name, value=value, group="qaic")


def test_broken_plugin_is_isolated_and_logged(fake_modules, caplog) -> None:
    pm = QaicPluginManager(strict=False)
    with caplog.at_level(logging.ERROR, logger="qaic.plugins"):
        pm.load_entry_points([_ep("broken", "fake_broken:missing_attr"), _ep("good", "fake_good")])
    assert "good" in pm.device_backends()
    assert "broken" in pm.load_errors
    assert "failed to load" in caplog.text and "broken" in caplog.text


def test_strict_mode_makes_a_broken_plugin_fatal(fake_modules) -> None:
    pm = QaicPluginManager(strict=True)
    with pytest.raises(QaicPluginError, match="QAIC_STRICT_PLUGINS"):
        pm.load_entry_points([_ep("broken", "does_not_exist_anywhere")])


def test_strict_mode_is_read_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("QAIC_STRICT_PLUGINS", "1")
    assert QaicPluginManager().strict is True
    monkeypatch.setenv("QAIC_STRICT_PLUGINS", "0")
    assert QaicPluginManager().strict is False


def test_duplicate_names_name_both_providers(fake_modules) -> None:
    pm = QaicPluginManager(strict=True)
    pm.register_plugin(fake_modules["fake_good"], "good", "pkg-one 1.0")
    pm.register_plugin(fake_modules["fake_dup"], "dup", "pkg-two 2.0")
    with pytest.raises(QaicPluginError) as err:
        pm.device_backends()
    assert "pkg-one 1.0" in str(err.value) and "pkg-two 2.0" in str(err.value)
    assert "'good'" in str(err.value)


def test_default_is_best_available_not_hook_order(fake_modules, monkeypatch) -> None:
    monkeypatch.delenv("QAIC_BACKEND", raising=False)
    for order in (["fake_other", "fake_good"], ["fake_good", "fake_other"]):
        pm = QaicPluginManager(strict=True)
        for name in order:
            pm.register_plugin(fake_modules[name], name, name)
        assert pm.select_device_backend().name == "good"


def test_unavailable_backends_are_not_chosen_by_default(monkeypatch) -> None:
    monkeypatch.delenv("QAIC_BACKEND", raising=False)
    pm = QaicPluginManager(strict=True)
    pm.register_plugin(_plugin_module("m1", _backend("best", priority=99, available=False)), "m1", "p1")
    pm.register_plugin(_plugin_module("m2", _backend("ok", priority=1)), "m2", "p2")
    assert pm.select_device_backend().name == "ok"
    with pytest.raises(QaicBackendNotFoundError, match="not available"):
        pm.select_device_backend("best")


def test_selection_by_environment(fake_modules, monkeypatch) -> None:
    pm = QaicPluginManager(strict=True)
    pm.register_plugin(fake_modules["fake_good"], "good", "g")
    pm.register_plugin(fake_modules["fake_other"], "other", "o")
    monkeypatch.setenv("QAIC_BACKEND", "other")
    assert pm.select_device_backend().name == "other"
    assert pm.select_device_backend("good").name == "good"


def test_unknown_backend_lists_installed_and_how_to_get_missing(fake_modules, monkeypatch) -> None:
    monkeypatch.setenv("QAIC_BACKEND", "nope")
    pm = QaicPluginManager(strict=True)
    pm.register_plugin(fake_modules["fake_good"], "good", "g")
    with pytest.raises(QaicBackendNotFoundError) as err:
        pm.select_device_backend()
    text = str(err.value)
    assert "'nope'" in text and "QAIC_BACKEND" in text
    assert "good (available)" in text
    assert "pip install qaic-sim" in text


def test_check_pending_rejects_an_unknown_hook() -> None:
    mod = types.ModuleType("typo_plugin")

    @hookimpl
    def qaic_device_backend() -> list[DeviceBackend]:  # misspelt: no such spec
        return []

    mod.qaic_device_backend = qaic_device_backend  # type: ignore[attr-defined]
    pm = QaicPluginManager(strict=True)
    pm.register_plugin(mod, "typo", "typo-pkg")
    with pytest.raises(pluggy.PluginValidationError, match="qaic_device_backend"):
        pm.check_pending()


def test_a_failing_availability_probe_counts_as_unavailable(monkeypatch) -> None:
    monkeypatch.delenv("QAIC_BACKEND", raising=False)

    def boom() -> bool:
        raise OSError("driver gone")

    bad = DeviceBackend("bad", "p", types.ModuleType, types.ModuleType, is_available=boom, priority=50)
    pm = QaicPluginManager(strict=True)
    pm.register_plugin(_plugin_module("mb", bad), "mb", "p")
    pm.register_plugin(_plugin_module("mo", _backend("ok")), "mo", "p")
    assert pm.select_device_backend().name == "ok"


def test_fresh_managers_do_not_share_state(fake_modules) -> None:
    first = QaicPluginManager(strict=True)
    first.register_plugin(fake_modules["fake_good"], "good", "g")
    second = QaicPluginManager(strict=True)
    assert "good" not in second.device_backends()


def test_installed_plugins_are_discovered() -> None:
    pm = get_plugin_manager(strict=True)
    backends = pm.device_backends()
    assert "qaicrt" in backends  # built into qaic-core
    assert "sim" in backends  # entry point of qaic-sim
    assert backends["qaicrt"].is_available() is False  # no Cloud AI SDK on this machine
