"""The platform reaches execution paths and attention backends through qaic-core's descriptors only."""

from __future__ import annotations

import pytest

from qaic_core import get_plugin_manager
from qaic_core.descriptors import AttentionBackend, ExecutionPath
from qaic_core.errors import QaicBackendNotFoundError, QaicConfigError
from qaic_core.execution import StepModel
from qaic_vllm.platform import ATTN_BACKEND_CLS, attention_backend_class


def _path(attention: str | None) -> ExecutionPath:
    def never(config: object) -> StepModel:
        raise AssertionError("not opened in this test")

    return ExecutionPath(
        name="eager-test",
        package="qaic-test",
        architectures=frozenset({"LlamaForCausalLM"}),
        open=never,
        attention_backend=attention,
    )


def test_a_path_without_attention_gets_the_placeholder() -> None:
    assert attention_backend_class(_path(None), {}) == ATTN_BACKEND_CLS


def test_a_path_gets_the_attention_backend_it_names() -> None:
    backend = AttentionBackend(name="qaic-sdpa", package="qaic-test", class_path="pkg.attn.QaicSdpaBackend")
    assert attention_backend_class(_path("qaic-sdpa"), {"qaic-sdpa": backend}) == "pkg.attn.QaicSdpaBackend"


def test_a_missing_attention_backend_names_the_path_and_the_fix() -> None:
    with pytest.raises(QaicConfigError, match=r"'eager-test'.*'qaic-sdpa'.*reinstall qaic-test"):
        attention_backend_class(_path("qaic-sdpa"), {})


def test_the_aot_path_is_registered_with_its_architectures() -> None:
    path = get_plugin_manager().select_execution_path("aot")
    assert path.package == "qaic-aot"
    assert {"LlamaForCausalLM", "Qwen2ForCausalLM"} <= path.architectures
    assert path.check is not None


def test_an_unknown_execution_path_lists_the_installed_ones() -> None:
    with pytest.raises(
        QaicBackendNotFoundError, match=r"unknown qaic execution path 'pty'.*installed paths: aot"
    ):
        get_plugin_manager().select_execution_path("pty")
