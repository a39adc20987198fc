"""Choosing the execution mode, and what the eager (pyt) mode refuses at start-up with the fix named."""

from __future__ import annotations

import inspect
import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from qaic_core.errors import QaicConfigError
from qaic_vllm import config as qconfig
from qaic_vllm.envs import VLLM_QAIC_EXECUTION_MODE

PYT = {"execution_mode": "pyt"}


@pytest.fixture(autouse=True)
def no_mode_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(VLLM_QAIC_EXECUTION_MODE, raising=False)


def cfg(additional: Any = None) -> Any:
    return SimpleNamespace(additional_config=additional)


def test_aot_is_the_mode_without_torch_qaic(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(qconfig, "torch_qaic_installed", lambda: False)
    assert qconfig.execution_path_of(cfg()) == "aot"
    assert qconfig.execution_path_of(None) == "aot"


def test_pyt_is_the_mode_when_torch_qaic_imports_as_in_the_vendors_plugin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(qconfig, "torch_qaic_installed", lambda: True)
    assert qconfig.execution_path_of(cfg({})) == "pyt"
    assert qconfig.execution_path_of(cfg({"execution_mode": "aot"})) == "aot"


def test_the_config_key_wins_over_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(VLLM_QAIC_EXECUTION_MODE, "pyt")
    assert qconfig.execution_path_of(cfg()) == "pyt"
    assert qconfig.execution_path_of(cfg({"execution_mode": "AOT"})) == "aot"
    monkeypatch.setenv(VLLM_QAIC_EXECUTION_MODE, " eager ")
    assert qconfig.execution_path_of(cfg({"override_qaic_config": {}})) == "pyt"


def test_an_unknown_mode_names_where_it_came_from_and_the_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(
        QaicConfigError, match=r"--additional-config execution_mode='jit' is not an execution mode"
    ):
        qconfig.execution_path_of(cfg({"execution_mode": "jit"}))
    monkeypatch.setenv(VLLM_QAIC_EXECUTION_MODE, "fast")
    with pytest.raises(QaicConfigError, match=r"VLLM_QAIC_EXECUTION_MODE='fast'.*use aot .* or pyt"):
        qconfig.execution_path_of(cfg())


def test_the_platform_reports_the_mode_and_the_paths_attention_backend() -> None:
    from vllm.config import VllmConfig, set_current_vllm_config

    from qaic_vllm.platform import ATTN_BACKEND_CLS, QaicPlatform

    with set_current_vllm_config(VllmConfig(additional_config=dict(PYT))):
        assert QaicPlatform.is_aot_inference() is False
        assert QaicPlatform.get_attn_backend_cls(None, None) == "qaic_pyt.attention.QaicPagedAttentionBackend"
    with set_current_vllm_config(VllmConfig(additional_config={"execution_mode": "aot"})):
        assert QaicPlatform.is_aot_inference() is True
        assert QaicPlatform.get_attn_backend_cls(None, None) == ATTN_BACKEND_CLS


def start(model: Path, **kwargs: Any) -> Any:
    """Engine arguments through vLLM's config check (the platform's check_and_update_config)."""
    from vllm import EngineArgs

    args = {"model": str(model), "max_model_len": 256, "dtype": "float32", "additional_config": dict(PYT)}
    args.update(kwargs)
    return EngineArgs(**args).create_engine_config()


def shaped_like(tiny_model: Path, out: Path, **config: Any) -> Path:
    """A model directory with the tiny model's tokenizer and a config.json of another size (no weights)."""
    out.mkdir(parents=True, exist_ok=True)
    for f in tiny_model.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, out / f.name)
    base = json.loads((tiny_model / "config.json").read_text())
    base.update(config)
    (out / "config.json").write_text(json.dumps(base))
    return out


def test_the_eager_mode_leaves_vllms_scheduler_and_prefix_caching_on(tiny_model: Path) -> None:
    vllm_config = start(tiny_model)
    assert vllm_config.parallel_config.worker_cls == "qaic_vllm.worker.QaicPagedWorker"
    # vLLM's own scheduling: the eager mode's scheduler adds the device-fault policy and nothing else.
    from vllm.v1.core.sched.scheduler import Scheduler

    from qaic_vllm.scheduler import QaicPagedScheduler, QaicScheduler

    assert vllm_config.scheduler_config.scheduler_cls == "qaic_vllm.scheduler.QaicPagedScheduler"
    plan = QaicPagedScheduler._schedule
    assert plan is not QaicScheduler._schedule and "Scheduler.schedule(self" in inspect.getsource(plan)
    assert issubclass(QaicPagedScheduler, Scheduler)
    assert vllm_config.cache_config.enable_prefix_caching
    assert vllm_config.cache_config.block_size == 16
    assert vllm_config.cache_config.num_gpu_blocks_override is None
    assert vllm_config.model_config.enforce_eager
    assert start(tiny_model, block_size=32, enable_prefix_caching=False).cache_config.block_size == 32


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"kv_cache_dtype": "fp8"}, "an mxint8 KV cache"),
        (
            {"additional_config": {**PYT, "override_qaic_config": {"num_cores": 4}}},
            "override_qaic_config num_cores",
        ),
        (
            {
                "additional_config": {
                    **PYT,
                    "override_qaic_config": {"aic_enable_depth_first": True, "mos": 2},
                }
            },
            "override_qaic_config aic_enable_depth_first, override_qaic_config mos",
        ),
        (
            {"additional_config": {**PYT, "override_qaic_config": {"max_num_partial_prefills": 2}}},
            "override_qaic_config max_num_partial_prefills sets how the aot mode's scheduler admits prompts",
        ),
    ],
)
def test_aot_only_features_fail_at_start_up_naming_the_mode(
    tiny_model: Path, kwargs: dict[str, Any], named: str
) -> None:
    with pytest.raises(Exception, match="pyt \\(eager\\) execution mode") as info:
        start(tiny_model, **kwargs)
    assert named in str(info.value)
    assert "VLLM_QAIC_EXECUTION_MODE=aot" in str(info.value)


def test_a_compile_variable_is_refused_in_the_eager_mode(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_QAIC_NUM_CORES", "8")
    with pytest.raises(Exception, match="VLLM_QAIC_NUM_CORES set compiled programs up"):
        start(tiny_model)


def test_tensor_parallel_across_socs_is_refused_clearly(tiny_model: Path) -> None:
    refused = r"tensor parallelism across SoCs.* is not supported in the pyt \(eager\)"
    with pytest.raises(Exception, match=refused):
        start(tiny_model, additional_config={**PYT, "override_qaic_config": {"device_group": [0, 1]}})
    with pytest.raises(Exception, match=refused):
        start(tiny_model, tensor_parallel_size=2)


def test_one_device_of_the_group_is_accepted(tiny_model: Path) -> None:
    vllm_config = start(tiny_model, additional_config={**PYT, "override_qaic_config": {"device_group": [2]}})
    assert vllm_config.parallel_config.worker_cls.endswith("QaicPagedWorker")


def test_a_model_too_big_for_the_card_fails_at_start_up_naming_the_fix(
    tiny_model: Path, tmp_path: Path
) -> None:
    big = shaped_like(
        tiny_model,
        tmp_path / "llama-70b-shaped",
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
    )
    with pytest.raises(
        Exception, match="does not fit QID 0 \\(simulated ultra\\) in the pyt \\(eager\\)"
    ) as info:
        start(big)
    text = str(info.value)
    assert "--dtype float16" in text and "a smaller model" in text and "QAIC_SIM_TOPOLOGY" in text
    with pytest.raises(Exception, match="does not fit") as info:
        start(big, dtype="float16")
    assert "--dtype float16" not in str(info.value)


def test_a_kv_cache_too_big_for_one_sequence_names_max_model_len(tiny_model: Path, tmp_path: Path) -> None:
    long = shaped_like(
        tiny_model,
        tmp_path / "long-context",
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=64,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=1 << 20,
    )
    with pytest.raises(Exception, match="a shorter --max-model-len"):
        start(long, max_model_len=1 << 20)
