"""Engine arguments -> platform settings and start-up errors, without starting an engine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from vllm.engine.arg_utils import EngineArgs

from qaic_core.errors import QaicConfigError


def engine_config(model: Path, **kwargs: Any) -> Any:
    args = {"model": str(model), "max_model_len": 256, "max_num_seqs": 4, "dtype": "float32", **kwargs}
    return EngineArgs(**args).create_engine_config()


def test_platform_is_qaic() -> None:
    from vllm.platforms import current_platform

    import qaic_vllm

    assert qaic_vllm.register() == "qaic_vllm.platform.QaicPlatform"
    assert current_platform.device_name == "qaic"
    assert current_platform.device_control_env_var == "QAIC_VISIBLE_DEVICES"
    assert current_platform.dispatch_key == "PrivateUse1"
    assert current_platform.dist_backend == "gloo"
    assert {"float32", "float16"} <= {
        str(d).removeprefix("torch.") for d in current_platform.supported_dtypes
    }


def test_register_needs_an_available_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    import qaic_core
    import qaic_vllm

    real = qaic_core.get_plugin_manager
    qaic_vllm._available_backends.cache_clear()
    # Only qaic-core's own backend (the real SDK, absent here): no backend is available.
    monkeypatch.setattr(qaic_core, "get_plugin_manager", lambda: real(entry_points=False))
    try:
        assert qaic_vllm.register() is None
    finally:
        monkeypatch.undo()
        qaic_vllm._available_backends.cache_clear()
    assert qaic_vllm.register() == qaic_vllm.register() == "qaic_vllm.platform.QaicPlatform"


def test_the_mode_is_known_outside_an_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    from qaic_vllm.platform import QaicPlatform

    monkeypatch.delenv("VLLM_QAIC_EXECUTION_MODE", raising=False)
    assert QaicPlatform.is_aot_inference() is True  # no current vLLM config: no torch_qaic, so aot
    monkeypatch.setenv("VLLM_QAIC_EXECUTION_MODE", "pyt")
    assert QaicPlatform.is_aot_inference() is False


def test_static_shape_settings(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.config import CompilationMode

    monkeypatch.delenv("QAIC_ASYNC_SCHEDULING", raising=False)
    cfg = engine_config(tiny_model, long_prefill_token_threshold=32)
    assert cfg.parallel_config.worker_cls == "qaic_vllm.worker.QaicWorker"
    assert cfg.scheduler_config.scheduler_cls == "qaic_vllm.scheduler.QaicScheduler"
    assert cfg.scheduler_config.async_scheduling is True  # vLLM's default, no variable needed
    assert cfg.scheduler_config.long_prefill_token_threshold == 32
    assert cfg.scheduler_config.max_num_batched_tokens >= 4 + 32
    assert cfg.cache_config.block_size == 256
    assert cfg.cache_config.num_gpu_blocks_override == 5
    assert cfg.cache_config.enable_prefix_caching is False
    assert cfg.compilation_config.mode == CompilationMode.NONE
    assert cfg.compilation_config.cudagraph_capture_sizes == []


def test_engine_args_map_to_compile_settings(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from qaic_vllm.config import engine_settings

    s = engine_settings(engine_config(tiny_model)).compile
    assert (s.full_batch_size, s.ctx_len, s.prefill_seq_len) == (4, 256, 128)  # 128 when unset
    assert not s.convert_to_fp16 and not s.mxint8 and not s.mxfp6
    assert engine_settings(engine_config(tiny_model, max_model_len=64)).compile.prefill_seq_len == 64

    s = engine_settings(engine_config(tiny_model, dtype="float16", kv_cache_dtype="fp8")).compile
    assert s.convert_to_fp16 and s.mxint8
    override = {
        "override_qaic_config": {
            "num_cores": 4,
            "mos": 2,
            "aic_enable_depth_first": True,
            "compiler_args": "-v",
        }
    }
    s = engine_settings(engine_config(tiny_model, additional_config=override)).compile
    assert (s.num_cores, s.mos, s.aic_enable_depth_first, s.compiler_args) == (4, 2, True, ("-v",))

    monkeypatch.setenv("VLLM_QAIC_NUM_CORES", "8")
    monkeypatch.setenv("VLLM_QAIC_DFS_EN", "1")
    s = engine_settings(engine_config(tiny_model)).compile
    assert (s.num_cores, s.aic_enable_depth_first) == (8, True)
    words = {"override_qaic_config": {"mxint8": "false", "mxfp6": "yes"}}  # JSON strings, not truthiness
    s = engine_settings(engine_config(tiny_model, kv_cache_dtype="fp8", additional_config=words)).compile
    assert (s.mxint8, s.mxfp6) == (False, True)


def test_mxint8_and_mxfp6_on_the_command_line(tiny_model: Path) -> None:
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from qaic_vllm.config import engine_settings

    parser = make_arg_parser(FlexibleArgumentParser())  # calls the platform's pre_register_and_update
    ns = parser.parse_args(
        [
            "--model",
            str(tiny_model),
            "--kv-cache-dtype",
            "mxint8",
            "--quantization",
            "mxfp6",
            "--max-model-len",
            "128",
        ]
    )
    assert ns.kv_cache_dtype == "fp8"
    cfg = EngineArgs.from_cli_args(ns).create_engine_config()
    s = engine_settings(cfg).compile
    assert s.mxint8 and s.mxfp6


@pytest.mark.parametrize(
    ("kwargs", "env", "needle"),
    [
        ({"additional_config": {"override_qaic_config": {"num_cores": 99}}}, {}, "num_cores"),
        ({"additional_config": {"override_qaic_config": {"cores": 4}}}, {}, "unknown keys ['cores']"),
        ({"additional_config": {"override_qaic_config": {"mos": 0}}}, {}, "mos"),
        (
            {"additional_config": {"override_qaic_config": {"mxfp6": "maybe"}}},
            {},
            "mxfp6='maybe' is not a boolean",
        ),
        (
            {"additional_config": {"override_qaic_config": {"mos": "two"}}},
            {},
            "mos='two' is not an integer: give a whole number",
        ),
        (
            {"additional_config": {"override_qaic_config": {"num_devices": 2, "device_group": [0, 1, 2]}}},
            {},
            "device_group",
        ),
        ({"additional_config": {"override_qaic_config": {"qpc_path": "/nonexistent/qpc"}}}, {}, "qpc_path"),
        (
            {"additional_config": {"override_qaic_config": {"max_num_partial_prefills": 5}}},
            {},
            "max_num_partial_prefills (5) exceeds --max-num-seqs (4)",
        ),
        (
            {"additional_config": {"override_qaic_config": {"max_num_partial_prefills": 0}}},
            {},
            "max_num_partial_prefills=0 must be >= 1",
        ),
        (
            {"additional_config": {"override_qaic_config": {"prefill_batch_seq_len": 128}}},
            {},
            "set --prefill-batch-size 2 or more",
        ),
        ({}, {"VLLM_QAIC_NUM_CORES": "lots"}, "VLLM_QAIC_NUM_CORES"),
        ({}, {"VLLM_QAIC_DFS_EN": "maybe"}, "VLLM_QAIC_DFS_EN"),
        ({"pipeline_parallel_size": 2}, {}, "num_devices"),
        ({"max_model_len": 100000}, {}, "max_model_len"),
        ({"dtype": "bfloat16"}, {}, "--dtype"),
    ],
)
def test_bad_settings_fail_at_startup_naming_the_fix(
    tiny_model: Path,
    monkeypatch: pytest.MonkeyPatch,
    kwargs: dict[str, Any],
    env: dict[str, str],
    needle: str,
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises((QaicConfigError, ValueError)) as info:
        engine_config(tiny_model, **kwargs)
    assert needle in str(info.value)


def _config_only_model(tmp_path: Path, config: dict[str, Any]) -> Path:
    from qaic_vllm.default_model import build_tokenizer

    model = tmp_path / config["model_type"]
    model.mkdir()
    (model / "config.json").write_text(json.dumps(config))
    build_tokenizer(model, 300)
    return model


def test_unsupported_architecture_lists_the_supported_ones(tmp_path: Path) -> None:
    model = _config_only_model(
        tmp_path,
        {
            "architectures": ["OPTForCausalLM"],
            "model_type": "opt",
            "vocab_size": 300,
            "hidden_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "ffn_dim": 64,
            "max_position_embeddings": 512,
            "word_embed_proj_dim": 32,
        },
    )
    with pytest.raises(ValueError, match="not supported on Cloud AI") as info:
        engine_config(model)
    assert "OPTForCausalLM" in str(info.value) and "LlamaForCausalLM" in str(info.value)


def test_mla_models_are_rejected(tmp_path: Path) -> None:
    model = _config_only_model(
        tmp_path,
        {
            "architectures": ["DeepseekV2ForCausalLM"],
            "model_type": "deepseek_v2",
            "vocab_size": 300,
            "hidden_size": 64,
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "kv_lora_rank": 16,
            "q_lora_rank": None,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 16,
            "v_head_dim": 16,
            "n_routed_experts": 2,
            "num_experts_per_tok": 1,
            "max_position_embeddings": 512,
        },
    )
    with pytest.raises(ValueError, match="MLA"):
        engine_config(model)


def test_override_keys_are_the_settings_tables() -> None:
    from qaic_core.settings import SETTINGS
    from qaic_vllm.config import OVERRIDE_KEYS

    overridable = {key for spec in SETTINGS.values() if spec.override for key in spec.keys}
    assert overridable | {"qpc_path", "max_num_partial_prefills"} == OVERRIDE_KEYS
    assert {"mxfp6_matmul", "mxint8_kv_cache", "dfs", "aic_num_cores"} <= OVERRIDE_KEYS
    # What an engine argument decides is not an override.
    assert not {"ctx_len", "full_batch_size", "prefill_seq_len", "convert_to_fp16"} & OVERRIDE_KEYS


def test_vendor_aliases_and_words_in_overrides(tiny_model: Path) -> None:
    from qaic_vllm.config import engine_settings

    vendor = {"aic_num_cores": "4", "mxfp6_matmul": "on", "dfs": "yes", "mxint8_kv_cache": False}
    cfg = engine_config(tiny_model, kv_cache_dtype="fp8", additional_config={"override_qaic_config": vendor})
    s = engine_settings(cfg).compile
    assert (s.num_cores, s.mxfp6, s.aic_enable_depth_first, s.mxint8) == (4, True, True, False)
    with pytest.raises((QaicConfigError, ValueError), match=r"unknown keys \['ctx_len'\]") as info:
        engine_config(tiny_model, additional_config={"override_qaic_config": {"ctx_len": 64}})
    assert "ctx_len with --max-model-len" in str(info.value)


def test_a_bad_value_reads_the_same_from_a_variable_and_an_override(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failure(env: dict[str, str], override: dict[str, Any]) -> str:
        with monkeypatch.context() as m:
            for key, value in env.items():
                m.setenv(key, value)
            with pytest.raises((QaicConfigError, ValueError)) as info:
                engine_config(tiny_model, additional_config={"override_qaic_config": override})
        return str(info.value)

    words = "='maybe' is not a boolean: use 1/0, true/false, yes/no or on/off"
    assert f"VLLM_QAIC_DFS_EN{words}" in failure({"VLLM_QAIC_DFS_EN": "maybe"}, {})
    assert f"--additional-config override_qaic_config dfs{words}" in failure({}, {"dfs": "maybe"})
    number = "='two' is not an integer: give a whole number"
    assert f"VLLM_QAIC_MOS{number}" in failure({"VLLM_QAIC_MOS": "two"}, {})
    assert f"--additional-config override_qaic_config aic_num_cores{number}" in failure(
        {}, {"aic_num_cores": "two"}
    )
