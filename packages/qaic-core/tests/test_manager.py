"""Plugin-manager behaviour: isolation, strictness, duplicates, selection, pending hooks."""

from __future__ import annotations

import logging
import sys
import types
from collections.abc import Iterator
from importlib.metadata import EntryPoint, PathDistribution
from pathlib import Path

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
    # The unknown hook is now caught when the plugin registers (pluggy's check_pending rule),
    # so the plugin never joins the manager and check_pending has nothing left to reject.
    mod = types.ModuleType("typo_plugin")

    @hookimpl
    def qaic_device_backend() -> list[DeviceBackend]:  # misspelt: no such spec
        return []

    mod.qaic_device_backend = qaic_device_backend  # type: ignore[attr-defined]
    pm = QaicPluginManager(strict=True)
    with pytest.raises(QaicPluginError, match="qaic_device_backend"):
        pm.register_plugin(mod, "typo", "typo-pkg")
    assert not pm.has_plugin("typo")
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


def _dist_entry_points(root: Path, dist: str, version: str, **entries: str) -> list[EntryPoint]:
    """Entry points of a throwaway installed distribution, so each carries its name and version."""
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    info.joinpath("METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    lines = "".join(f"{name} = {value}\n" for name, value in entries.items())
    info.joinpath("entry_points.txt").write_text(f"[qaic]\n{lines}")
    return list(PathDistribution(info).entry_points)


def _raising_module(modname: str) -> types.ModuleType:
    mod = types.ModuleType(modname)

    @hookimpl
    def qaic_device_backends() -> list[DeviceBackend]:
        raise RuntimeError("driver table corrupt")

    mod.qaic_device_backends = qaic_device_backends  # type: ignore[attr-defined]
    return mod


def _returning_module(modname: str, value: object) -> types.ModuleType:
    mod = types.ModuleType(modname)

    @hookimpl
    def qaic_device_backends() -> object:
        return value

    mod.qaic_device_backends = qaic_device_backends  # type: ignore[attr-defined]
    return mod


def _typo_module(modname: str) -> types.ModuleType:
    mod = types.ModuleType(modname)

    @hookimpl
    def qaic_device_backend() -> list[DeviceBackend]:  # misspelt: no such spec
        return [_backend("typo")]

    mod.qaic_device_backend = qaic_device_backend  # type: ignore[attr-defined]
    return mod


def test_a_raising_hook_skips_only_its_plugin(fake_modules, monkeypatch, caplog) -> None:
    monkeypatch.delenv("QAIC_BACKEND", raising=False)
    pm = QaicPluginManager(strict=False)
    pm.register_plugin(_raising_module("m_bad"), "bad", "pkg-bad 1.2")
    pm.register_plugin(fake_modules["fake_good"], "good", "pkg-good 1.0")
    with caplog.at_level(logging.ERROR, logger="qaic.plugins"):
        assert pm.select_device_backend().name == "good"
        assert pm.select_device_backend("good").name == "good"
        assert set(pm.device_backends()) == {"good"}
    errors = [r for r in caplog.records if r.name == "qaic.plugins" and r.levelno == logging.ERROR]
    assert len(errors) == 1, "a failing hook is logged once, not on every lookup"
    text = errors[0].getMessage()
    assert "'bad'" in text and "pkg-bad 1.2" in text and "RuntimeError: driver table corrupt" in text
    assert "qaic_device_backends" in text
    assert "driver table corrupt" in pm.load_errors["bad"]


def test_a_raising_hook_is_fatal_when_strict(fake_modules) -> None:
    pm = QaicPluginManager(strict=True)
    pm.register_plugin(_raising_module("m_bad"), "bad", "pkg-bad 1.2")
    pm.register_plugin(fake_modules["fake_good"], "good", "pkg-good 1.0")
    with pytest.raises(QaicPluginError) as err:
        pm.select_device_backend("good")
    text = str(err.value)
    assert "'bad'" in text and "pkg-bad 1.2" in text and "RuntimeError: driver table corrupt" in text
    assert "QAIC_STRICT_PLUGINS" in text
    assert isinstance(err.value.__cause__, RuntimeError)


@pytest.mark.parametrize(
    "garbage",
    [
        "sim",
        _backend("fine"),
        [object()],
        [_backend("")],
        (x for x in [_backend("lazy")]),
    ],
    ids=["str", "bare-descriptor", "wrong-type", "empty-name", "generator"],
)
def test_a_hook_returning_garbage_is_treated_like_one_that_raised(fake_modules, garbage, caplog) -> None:
    pm = QaicPluginManager(strict=False)
    pm.register_plugin(_returning_module("m_junk", garbage), "junk", "pkg-junk 0.1")
    pm.register_plugin(fake_modules["fake_good"], "good", "pkg-good 1.0")
    with caplog.at_level(logging.ERROR, logger="qaic.plugins"):
        assert set(pm.device_backends()) == {"good"}
    assert "'junk'" in caplog.text and "pkg-junk 0.1" in caplog.text and "returned" in caplog.text
    assert "junk" in pm.load_errors

    strict = QaicPluginManager(strict=True)
    strict.register_plugin(_returning_module("m_junk", garbage), "junk", "pkg-junk 0.1")
    with pytest.raises(QaicPluginError, match=r"pkg-junk 0\.1"):
        strict.device_backends()


def test_a_plugin_returning_none_or_nothing_is_fine(fake_modules) -> None:
    pm = QaicPluginManager(strict=True)
    pm.register_plugin(_returning_module("m_none", None), "none", "p")
    pm.register_plugin(_returning_module("m_empty", ()), "empty", "p")
    pm.register_plugin(fake_modules["fake_good"], "good", "g")
    assert set(pm.device_backends()) == {"good"}
    assert not pm.load_errors


def test_a_misspelt_hook_skips_only_its_plugin(fake_modules, tmp_path, caplog) -> None:
    sys.modules["fake_typo"] = _typo_module("fake_typo")
    try:
        eps = _dist_entry_points(tmp_path, "typo-pkg", "0.3", typo="fake_typo")
        eps += _dist_entry_points(tmp_path, "good-pkg", "1.0", good="fake_good")
        pm = QaicPluginManager(strict=False)
        with caplog.at_level(logging.ERROR, logger="qaic.plugins"):
            pm.load_entry_points(eps)
    finally:
        sys.modules.pop("fake_typo", None)
    assert not pm.has_plugin("typo") and pm.has_plugin("good")
    assert set(pm.device_backends()) == {"good"}
    pm.check_pending()  # the typo never joined, so nothing is left pending
    assert "'typo'" in caplog.text and "typo-pkg 0.3" in caplog.text
    assert "qaic_device_backend" in caplog.text and "unknown hook" in caplog.text
    assert "unknown hook" in pm.load_errors["typo"]


def test_a_misspelt_hook_is_fatal_when_strict(fake_modules, tmp_path) -> None:
    sys.modules["fake_typo"] = _typo_module("fake_typo")
    try:
        pm = QaicPluginManager(strict=True)
        with pytest.raises(QaicPluginError) as err:
            pm.load_entry_points(_dist_entry_points(tmp_path, "typo-pkg", "0.3", typo="fake_typo"))
    finally:
        sys.modules.pop("fake_typo", None)
    text = str(err.value)
    assert "'typo'" in text and "typo-pkg 0.3" in text and "qaic_device_backend" in text
    assert not pm.has_plugin("typo")


def test_a_duplicate_entry_point_name_names_both_providers(fake_modules, tmp_path, caplog) -> None:
    eps = _dist_entry_points(tmp_path / "a", "first-pkg", "1.0", good="fake_good")
    eps += _dist_entry_points(tmp_path / "b", "second-pkg", "2.0", good="fake_dup")
    pm = QaicPluginManager(strict=False)
    with caplog.at_level(logging.ERROR, logger="qaic.plugins"):
        pm.load_entry_points(eps)
    assert pm.get_plugin("good") is fake_modules["fake_good"]
    assert "first-pkg 1.0" in caplog.text and "second-pkg 2.0" in caplog.text and "'good'" in caplog.text
    assert "second-pkg 2.0" in pm.load_errors["good"]

    strict = QaicPluginManager(strict=True)
    with pytest.raises(QaicPluginError) as err:
        strict.load_entry_points(eps)
    assert "first-pkg 1.0" in str(err.value) and "second-pkg 2.0" in str(err.value)


def test_an_entry_point_named_like_the_builtin_backend_is_reported(fake_modules, tmp_path, caplog) -> None:
    pm = QaicPluginManager(strict=False)
    pm.load_builtin()
    with caplog.at_level(logging.ERROR, logger="qaic.plugins"):
        pm.load_entry_points(_dist_entry_points(tmp_path, "shadow-pkg", "9.9", qaicrt="fake_good"))
    assert "shadow-pkg 9.9" in caplog.text and "qaic-core" in caplog.text and "'qaicrt'" in caplog.text
    assert "good" not in pm.device_backends()


def test_loading_the_same_entry_points_twice_is_quiet(fake_modules, tmp_path, caplog) -> None:
    eps = _dist_entry_points(tmp_path, "good-pkg", "1.0", good="fake_good")
    pm = QaicPluginManager(strict=True)
    pm.load_entry_points(eps)
    pm.load_entry_points(eps)
    assert not pm.load_errors


def test_tracing_switch_writes_hook_calls_to_the_log(fake_modules, monkeypatch, caplog) -> None:
    monkeypatch.setenv("QAIC_TRACE_PLUGINS", "1")
    pm = QaicPluginManager(strict=True)
    pm.register_plugin(fake_modules["fake_good"], "good", "g")
    with caplog.at_level(logging.DEBUG, logger="qaic.plugins"):
        pm.device_backends()
    lines = [
        r.getMessage() for r in caplog.records if r.name == "qaic.plugins" and r.levelno == logging.DEBUG
    ]
    assert any("qaic_device_backends" in line for line in lines), lines
    assert any("finish" in line for line in lines), lines


def test_tracing_is_off_by_default(fake_modules, monkeypatch, caplog) -> None:
    monkeypatch.delenv("QAIC_TRACE_PLUGINS", raising=False)
    pm = QaicPluginManager(strict=True)
    pm.register_plugin(fake_modules["fake_good"], "good", "g")
    with caplog.at_level(logging.DEBUG, logger="qaic.plugins"):
        pm.device_backends()
    assert not [r for r in caplog.records if r.name == "qaic.plugins"]


def test_a_plugin_registered_without_a_provider_is_named_by_its_distribution(caplog) -> None:
    pm = QaicPluginManager(strict=False)
    with caplog.at_level(logging.ERROR, logger="qaic.plugins"):
        assert pm.register(_typo_module("pluggy"), name="anon") is None
    assert f"pluggy {pluggy.__version__}" in caplog.text
