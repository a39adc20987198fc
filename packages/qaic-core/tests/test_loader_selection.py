"""Model loaders and session factories: listed by name, chosen by configuration and environment, never by order."""

from __future__ import annotations

import dataclasses
import types
from pathlib import Path
from typing import Any

import pytest

from qaic_core import (
    DeviceBackend,
    QaicBackendNotFoundError,
    QaicConfigError,
    QaicPluginError,
    QaicPluginManager,
    hookimpl,
)
from qaic_core.descriptors import (
    HF_CHECKPOINT,
    PROGRAM_KINDS,
    QPC,
    VLLM_CLASSES,
    ExecutionPath,
    ModelLoader,
    SessionFactory,
)
from qaic_core.env import QAIC_MODEL_LOADER, QAIC_SESSION_FACTORY
from qaic_core.execution import ExecutionConfig
from qaic_core.session import SessionRequest
from qaic_core.settings import CompileSettings


def _loader(name: str, kind: str = QPC, *, priority: int = 0, applies: bool = True) -> ModelLoader:
    return ModelLoader(
        name=name,
        package=f"pkg-{name}",
        kind=kind,
        load=lambda config: Path(name),
        applies=lambda config: applies,
        description=f"loads {name}",
        priority=priority,
    )


def _factory(name: str, *, priority: int = 0, available: bool = True) -> SessionFactory:
    def open_session(request: SessionRequest) -> Any:
        raise AssertionError("not opened in these tests")

    return SessionFactory(
        name=name,
        package=f"pkg-{name}",
        open=open_session,
        is_available=lambda: available,
        description=f"sessions of {name}",
        priority=priority,
    )


class Provider:
    """A plugin object returning the given loaders and factories."""

    def __init__(self, loaders: list[ModelLoader], factories: list[SessionFactory] = []) -> None:  # noqa: B006
        self.loaders = loaders
        self.factories = factories

    @hookimpl
    def qaic_model_loaders(self) -> list[ModelLoader]:
        return self.loaders

    @hookimpl
    def qaic_session_factories(self) -> list[SessionFactory]:
        return self.factories


def _manager(*providers: tuple[str, Provider]) -> QaicPluginManager:
    pm = QaicPluginManager(strict=True)
    for name, provider in providers:
        pm.register_plugin(provider, name, f"{name} 1.0")
    return pm


@pytest.fixture
def config(tmp_path: Path) -> ExecutionConfig:
    device = DeviceBackend(
        name="none",
        package="pkg-none",
        runtime=lambda: types.ModuleType("rt"),
        aicapi=lambda: types.ModuleType("api"),
    )
    return ExecutionConfig(model_dir=tmp_path, settings=CompileSettings(), device=device)


@pytest.fixture(autouse=True)
def _no_names_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(QAIC_MODEL_LOADER, raising=False)
    monkeypatch.delenv(QAIC_SESSION_FACTORY, raising=False)


def test_duplicate_names_name_both_providers() -> None:
    pm = _manager(
        ("first", Provider([_loader("store")], [_factory("s")])), ("second", Provider([_loader("store")]))
    )
    with pytest.raises(QaicPluginError) as err:
        pm.model_loaders()
    assert "'store'" in str(err.value) and "first 1.0" in str(err.value) and "second 1.0" in str(err.value)
    pm = _manager(("first", Provider([], [_factory("s")])), ("second", Provider([], [_factory("s")])))
    with pytest.raises(QaicPluginError, match=r"first 1.0.*second 1.0"):
        pm.session_factories()


def test_the_default_is_the_best_applicable_loader_whatever_the_order(config: ExecutionConfig) -> None:
    loaders = [
        _loader("hf", HF_CHECKPOINT, priority=10),
        _loader("zzz", QPC, priority=10),
        _loader("best-but-not-here", QPC, priority=50, applies=False),
        _loader("eager", VLLM_CLASSES, priority=99),
        _loader("plugin", QPC),
    ]
    for order in (loaders, loaders[::-1]):
        pm = _manager(*((f"p{i}", Provider([loader])) for i, loader in enumerate(order)))
        assert pm.select_model_loader(config, PROGRAM_KINDS, "aot").name == "hf"  # 10, then the first name
        assert pm.select_model_loader(config, {VLLM_CLASSES}, "pyt").name == "eager"


def test_a_loader_is_chosen_by_configuration_then_environment(
    config: ExecutionConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    pm = _manager(
        ("p", Provider([_loader("hf", HF_CHECKPOINT, priority=10), _loader("store"), _loader("other")]))
    )
    monkeypatch.setenv(QAIC_MODEL_LOADER, "store")
    assert pm.select_model_loader(config, PROGRAM_KINDS, "aot").name == "store"
    named = dataclasses.replace(config, loader="other")
    assert pm.select_model_loader(named, PROGRAM_KINDS, "aot").name == "other"


def test_a_named_loader_must_exist_take_the_paths_kind_and_apply(
    config: ExecutionConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    pm = _manager(
        (
            "p",
            Provider(
                [_loader("hf", HF_CHECKPOINT), _loader("eager", VLLM_CLASSES), _loader("no", applies=False)]
            ),
        )
    )
    monkeypatch.setenv(QAIC_MODEL_LOADER, "missing")
    with pytest.raises(
        QaicBackendNotFoundError, match=f"'missing' \\(from {QAIC_MODEL_LOADER}\\).*hf \\(hf_checkpoint\\)"
    ):
        pm.select_model_loader(config, PROGRAM_KINDS, "aot")
    with pytest.raises(QaicConfigError, match=r"'eager'.*loads vllm_classes.*aot execution path"):
        pm.select_model_loader(dataclasses.replace(config, loader="eager"), PROGRAM_KINDS, "aot")
    with pytest.raises(QaicConfigError, match=r"'no'.*cannot load"):
        pm.select_model_loader(dataclasses.replace(config, loader="no"), PROGRAM_KINDS, "aot")


def test_session_factories_by_name_environment_and_priority(monkeypatch: pytest.MonkeyPatch) -> None:
    factories = [
        _factory("qaicrt", priority=10),
        _factory("tracing"),
        _factory("fast", priority=90, available=False),
    ]
    for order in (factories, factories[::-1]):
        pm = _manager(*((f"p{i}", Provider([], [f])) for i, f in enumerate(order)))
        assert pm.select_session_factory().name == "qaicrt"  # the unavailable one is never the default
        assert pm.select_session_factory("tracing").name == "tracing"
    monkeypatch.setenv(QAIC_SESSION_FACTORY, "tracing")
    assert pm.select_session_factory().name == "tracing"
    assert pm.select_session_factory("qaicrt").name == "qaicrt"  # configuration wins over the environment
    with pytest.raises(QaicBackendNotFoundError, match=r"'fast'.*cannot run here"):
        pm.select_session_factory("fast")
    monkeypatch.setenv(QAIC_SESSION_FACTORY, "nope")
    with pytest.raises(
        QaicBackendNotFoundError, match=f"'nope' \\(from {QAIC_SESSION_FACTORY}\\).*fast, qaicrt, tracing"
    ):
        pm.select_session_factory()


class PathProvider:
    """A plugin object returning one execution path that claims ``capabilities``."""

    def __init__(self, capabilities: frozenset[str]) -> None:
        self.capabilities = capabilities

    @hookimpl
    def qaic_execution_paths(self) -> list[ExecutionPath]:
        return [
            ExecutionPath(
                name="odd",
                package="pkg-odd",
                architectures=frozenset({"LlamaForCausalLM"}),
                open=lambda config: None,  # type: ignore[arg-type,return-value]
                capabilities=self.capabilities,
            )
        ]


def test_an_execution_path_claiming_an_unknown_capability_is_refused_naming_it() -> None:
    assert set(_manager(("odd", PathProvider(frozenset({"overlap"})))).execution_paths()) == {"odd"}
    with pytest.raises(QaicPluginError) as err:
        _manager(("odd", PathProvider(frozenset({"overlap", "overlapp"})))).execution_paths()
    assert "execution path 'odd' (pkg-odd)" in str(err.value) and "['overlapp']" in str(err.value)
