"""vllm-qaic's configuration, unchanged: every key, variable and engine argument it documents either works
or is refused at start-up as recognised; defaults are sized to the device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm.engine.arg_utils import EngineArgs

from qaic_core.errors import QaicConfigError
from qaic_core.settings import CompileSettings
from qaic_core.types import SkuType
from qaic_vllm import envs, vendor

Check = Callable[[CompileSettings], bool]
REFUSED = "refused"
POOLING_ONLY = "pooling only"
"""Honoured by a pooling engine (--runner pooling, test_vllm_pooling.py); a generation engine refuses it."""


def engine_config(model: Path, **kwargs: Any) -> Any:
    args = {"model": str(model), "max_model_len": 256, "max_num_seqs": 4, "dtype": "float32", **kwargs}
    return EngineArgs(**args).create_engine_config()


def settings_of(model: Path, **kwargs: Any) -> CompileSettings:
    from qaic_vllm.config import engine_settings

    return engine_settings(engine_config(model, **kwargs)).compile


def flag(name: str) -> Check:
    return lambda s: name in s.compiler_args


# key -> [(value, expected)]: a check on the compile settings, REFUSED, or None (accepted, no change to check)
OVERRIDE_CASES: dict[str, list[tuple[Any, Check | str | None]]] = {
    "num_cores": [(4, lambda s: s.num_cores == 4)],
    "aic_num_cores": [("4", lambda s: s.num_cores == 4)],
    "dfs": [(False, lambda s: not s.aic_enable_depth_first)],
    "aic_enable_depth_first": [("false", lambda s: not s.aic_enable_depth_first)],
    "mos": [(-1, lambda s: s.mos is None), (2, lambda s: s.mos == 2)],
    "num_devices": [(2, lambda s: s.num_devices == 2)],
    "device_group": [([0, 1], lambda s: s.device_group == (0, 1) and s.num_devices == 2)],
    "device_ids": [("[1, 2]", lambda s: s.device_group == (1, 2) and s.num_devices == 2)],
    "device_id": [(1, lambda s: s.device_group == (1,))],
    "mxfp6": [(True, lambda s: s.mxfp6)],
    "mxfp6_matmul": [("true", lambda s: s.mxfp6)],
    "mxfp6_en": [(1, lambda s: s.mxfp6)],
    "mxint8": [(True, lambda s: s.mxint8)],
    "mxint8_kv_cache": [("1", lambda s: s.mxint8)],
    "mxint8_en": [(True, lambda s: s.mxint8)],
    "compiler_args": [
        ("mos=2|aic_perf_metrics", lambda s: s.mos == 2 and "-aic-perf-metrics" in s.compiler_args),
        (
            "-aic-perf-warnings -stats-batchsize=2",
            lambda s: s.compiler_args == ("-aic-perf-warnings", "-stats-batchsize=2"),
        ),
    ],
    "qpc_path": [("/nonexistent/qpc", REFUSED)],  # read, then checked: a missing QPC stops start-up
    "prefill_seq_len": [(64, lambda s: s.prefill_seq_len == 64)],
    "mdts_mos": [(2, flag("-mdts-mos=2"))],
    "aic_pmu_recipe": [("KernelUtil", flag("-aic-pmu-recipe=KernelUtil"))],
    "node_precision_info": [("/tmp/npi.yaml", flag("-node-precision-info=/tmp/npi.yaml")), (True, REFUSED)],
    "continuous_batching": [(True, None), (False, REFUSED)],
    "compile_only": [(True, REFUSED), (False, None)],
    "mdp_load_partition_config": [("mdp.json", REFUSED)],
    "mdp_dump_partition_config": [("dump.json", REFUSED)],
    "mdp_compiler_dump_path": [("dumps", REFUSED)],
    "stages": [(2, REFUSED), (1, None)],
    "ccl_enabled": [
        (True, lambda s: s.ccl_enabled and s.compute_context_lengths == ((256,), (256,))),
        (False, lambda s: s.compute_context_lengths is None),
    ],
    "comp_ctx_lengths_prefill": [([128], lambda s: s.compute_context_lengths == ((128, 256), (256,)))],
    "comp_ctx_lengths_decode": [
        ([128, 256], lambda s: s.compute_context_lengths == ((256,), (128, 256))),
        ("64,128", lambda s: s.comp_ctx_lengths_decode == (64, 128)),
    ],
    "prefill_only": [(True, REFUSED), (False, REFUSED), (None, None)],
    "split_retained_state_io": [(True, REFUSED), (False, None)],
    "kv_cache_batch_size": [(8, REFUSED)],
    "aic_include_sampler": [(True, REFUSED), (False, None)],
    "aic_return_pdfs": [(True, None)],
    "max_top_k_ids": [(512, None)],
    "aic_include_guided_decoding": [(True, None)],
    "pooling_device": [("qaic", POOLING_ONLY)],
    "pooling_method": [("mean", POOLING_ONLY)],
    "normalize": [(True, POOLING_ONLY)],
    "softmax": [(True, POOLING_ONLY)],
    "task": [("embed", POOLING_ONLY)],
    "embed_seq_len": [([32, 256], POOLING_ONLY)],
    "kv_offload": [(True, REFUSED), (False, None)],
    "num_patches": [(4, REFUSED)],
    "height": [([364], REFUSED)],
    "width": [([532], REFUSED)],
    "img_size": [(448, REFUSED)],
    "max_num_tiles": [(2, REFUSED)],
    "vision_size": [(100, REFUSED)],
    "encoder_ctx_len": [(1500, REFUSED)],
    "skip_lang": [(True, REFUSED)],
    "skip_vision": [(True, REFUSED)],
    "mm_processor_kwargs": [({"max_pixels": 1}, REFUSED)],
    "qaic_config": [({"include_sampler": True}, REFUSED)],
    "pretrained_extra_args": [({"revision": "x"}, REFUSED)],
}


def test_every_override_key_vllm_qaic_reads_has_a_case() -> None:
    assert set(OVERRIDE_CASES) == set(vendor.OVERRIDE_KEYS)


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [(k, v, e) for k, cases in OVERRIDE_CASES.items() for v, e in cases],
    ids=[f"{k}={v!r}" for k, cases in OVERRIDE_CASES.items() for v, _ in cases],
)
def test_override_key(tiny_model: Path, key: str, value: Any, expected: Check | str | None) -> None:
    additional = {"override_qaic_config": {key: value}}
    if key in ("num_devices", "device_group", "device_ids", "device_id"):
        additional["override_qaic_config"]["num_cores"] = 4  # skip the device query for ids > 0
    if expected == POOLING_ONLY:
        with pytest.raises((QaicConfigError, ValueError), match="--runner pooling") as info:
            settings_of(tiny_model, additional_config=additional)
        assert key in str(info.value)
        return
    if expected == REFUSED:
        with pytest.raises((QaicConfigError, ValueError)) as info:
            settings_of(tiny_model, additional_config=additional)
        text = str(info.value)
        assert key in text
        if key != "qpc_path":
            assert "is recognised" in text and "not supported by this plugin yet" in text
        return
    s = settings_of(tiny_model, additional_config=additional)
    if callable(expected):
        assert expected(s), s


def test_a_qaic_compile_flag_name_becomes_that_flag(tiny_model: Path) -> None:
    s = settings_of(
        tiny_model, additional_config={"override_qaic_config": {"aic_perf_metrics": True, "ols": 2}}
    )
    assert s.compiler_args == ("-aic-perf-metrics", "-ols=2")
    with pytest.raises((QaicConfigError, ValueError), match=r"unknown keys \['cores'\]"):
        settings_of(tiny_model, additional_config={"override_qaic_config": {"cores": 4}})


def test_vllm_qaic_defaults(tiny_model: Path) -> None:
    s = settings_of(tiny_model)
    assert s.aic_enable_depth_first  # dfs on, as in vllm-qaic
    assert s.num_cores == 16  # the default simulated card: Cloud AI 100 Ultra, 16 NSPs per SoC
    assert s.mos is None  # -1: the compiler's choice


# -- top-level additional_config keys ------------------------------------------------------------
def test_top_level_device_group_is_read(tiny_model: Path) -> None:
    s = settings_of(tiny_model, additional_config={"device_group": [1, 2]})
    assert (s.device_group, s.num_devices) == ((1, 2), 2)
    both = {"device_group": [1, 2], "override_qaic_config": {"device_group": [3]}}
    assert settings_of(tiny_model, additional_config=both).device_group == (3,)  # the override wins
    # vllm-qaic's tests pass override_qaic_config None.
    none = {"device_group": [0], "override_qaic_config": None}
    assert settings_of(tiny_model, additional_config=none).device_group == (0,)
    # vLLM 0.34 takes only a dict here; the string forms vllm-qaic accepts still parse.
    assert vendor.parse_additional_config("{'device_group': [2]}") == {"device_group": [2]}
    assert vendor.parse_additional_config('{"device_group": [2]}') == {"device_group": [2]}


@pytest.mark.parametrize(
    ("key", "value"), [("lora_modules", [{"name": "a", "path": "/a"}]), ("height", [364]), ("width", [532])]
)
def test_top_level_keys_of_missing_features_are_refused(tiny_model: Path, key: str, value: Any) -> None:
    with pytest.raises((QaicConfigError, ValueError), match=f"{key} is recognised"):
        settings_of(tiny_model, additional_config={key: value})
    settings_of(tiny_model, additional_config={key: None})  # off is fine


def test_every_top_level_key_has_a_case() -> None:
    covered = {"device_group", "override_qaic_config", "lora_modules", "height", "width"}
    covered |= {"draft_override_qaic_config"}  # test_spec_draft_variables
    assert covered == set(vendor.ADDITIONAL_KEYS)


# -- VLLM_QAIC_* and the other variables vllm-qaic reads ------------------------------------------------
def test_variables_win_over_additional_config(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    override = {"override_qaic_config": {"num_cores": 4, "mos": 3, "dfs": True}}
    monkeypatch.setenv("VLLM_QAIC_NUM_CORES", "6")
    monkeypatch.setenv("VLLM_QAIC_MOS", "-1")
    monkeypatch.setenv("VLLM_QAIC_DFS_EN", "0")
    monkeypatch.setenv("VLLM_QAIC_COMPILER_ARGS", "aic_perf_metrics|stats_batchsize=4")
    s = settings_of(tiny_model, additional_config=override)
    assert (s.num_cores, s.mos, s.aic_enable_depth_first) == (6, None, False)
    assert s.compiler_args == ("-aic-perf-metrics", "-stats-batchsize=4")
    monkeypatch.setenv("VLLM_QAIC_QPC_PATH", "/nonexistent/qpc")
    with pytest.raises((QaicConfigError, ValueError), match="VLLM_QAIC_QPC_PATH"):
        settings_of(tiny_model)


def test_max_cpu_threads_and_lrt_debug() -> None:
    assert envs.max_cpu_threads({"VLLM_QAIC_MAX_CPU_THREADS": "2"}) == 2
    assert envs.lrt_debug({"VLLM_QAIC_ENABLE_LRT_DEBUG": "1"}) is True
    assert envs.lrt_debug({}) is False


def test_spec_target_variables(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from qaic_vllm.config import engine_settings
    from qaic_vllm.speculative.config import with_speculation

    for name, value in {
        "VLLM_QAIC_SPEC_TARGET_NUM_CORES": "6",
        "VLLM_QAIC_SPEC_TARGET_MOS": "2",
        "VLLM_QAIC_SPEC_TARGET_DFS_EN": "0",
        "VLLM_QAIC_SPEC_TARGET_QID": "1",
        "VLLM_QAIC_SPEC_TARGET_COMPILER_ARGS": "aic_perf_metrics",
    }.items():
        monkeypatch.setenv(name, value)
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    cfg = engine_config(tiny_model, speculative_config=spec)
    target, _ = with_speculation(cfg, engine_settings(cfg))
    s = target.compile
    assert (s.num_cores, s.mos, s.aic_enable_depth_first, s.device_group) == (6, 2, False, (1,))
    assert s.compiler_args == ("-aic-perf-metrics",)
    assert settings_of(tiny_model).num_cores == 16  # without speculation the target variables are not read
    monkeypatch.setenv("VLLM_QAIC_SPEC_TARGET_QPC_PATH", "/nonexistent/qpc")
    with pytest.raises((QaicConfigError, ValueError), match="qpc_path"):
        engine_config(tiny_model, speculative_config=spec)


def test_spec_draft_variables(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from qaic_vllm.config import engine_settings
    from qaic_vllm.speculative.config import with_speculation

    spec = {"method": "draft_model", "model": str(tiny_model), "num_speculative_tokens": 2}
    draft_override = {"draft_override_qaic_config": {"num_cores": 4, "mos": 1}}
    cfg = engine_config(tiny_model, speculative_config=spec, additional_config=draft_override)
    target, settings = with_speculation(cfg, engine_settings(cfg))
    assert settings is not None and settings.draft is not None
    assert (target.compile.num_cores, settings.draft.num_cores, settings.draft.mos) == (8, 4, 1)
    for name, value in {
        "VLLM_QAIC_SPEC_DRAFT_NUM_CORES": "2",
        "VLLM_QAIC_SPEC_DRAFT_MOS": "3",
        "VLLM_QAIC_SPEC_DRAFT_DFS_EN": "0",
        "VLLM_QAIC_SPEC_DRAFT_KV_COMPRESSION": "1",
        "VLLM_QAIC_SPEC_DRAFT_QID": "1",
        "VLLM_QAIC_SPEC_DRAFT_COMPILER_ARGS": "aic_perf_warnings",
        "VLLM_QAIC_SPEC_DRAFT_QPC_PATH": "/some/draft/qpc",
    }.items():
        monkeypatch.setenv(name, value)
    target, settings = with_speculation(cfg, engine_settings(cfg))
    assert settings is not None and settings.draft is not None
    d = settings.draft
    assert (d.num_cores, d.mos, d.aic_enable_depth_first, d.mxint8, d.device_group) == (
        2,
        3,
        False,
        True,
        (1,),
    )
    assert d.compiler_args == ("-aic-perf-warnings",)
    assert settings.draft_qpc_path == Path("/some/draft/qpc")


@pytest.mark.parametrize(
    "name", sorted(n for n, k in vendor.ENV_VARS.items() if k.handling == vendor.NO_EFFECT)
)
def test_variables_without_effect_are_accepted_and_logged(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, name: str
) -> None:
    monkeypatch.setenv(name, "1")
    with caplog.at_level("INFO", logger="qaic.vllm"):
        settings_of(tiny_model)
    assert any(name in r.getMessage() and "no effect" in r.getMessage() for r in caplog.records)


def test_every_variable_has_a_case() -> None:
    covered = {"VLLM_QAIC_QPC_PATH", "VLLM_QAIC_NUM_CORES", "VLLM_QAIC_MOS", "VLLM_QAIC_DFS_EN"}
    covered |= {"VLLM_QAIC_COMPILER_ARGS", "VLLM_QAIC_MAX_CPU_THREADS", "VLLM_QAIC_ENABLE_LRT_DEBUG"}
    covered |= set(envs.SPEC_TARGET_VARS) | set(envs.SPEC_DRAFT_VARS) | {"VLLM_TORCH_QAIC_PROFILER_DIR"}
    covered |= {n for n, k in vendor.ENV_VARS.items() if k.handling == vendor.NO_EFFECT}
    assert covered == set(vendor.ENV_VARS)
    assert set(vendor.ENV_VARS) <= set(envs.ENV_VARS)  # registered with vLLM, documented in docs/vllm.md


def test_qaic_profiler_dir_names_the_trace_folder(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_TORCH_QAIC_PROFILER_DIR", "/tmp/qaic-traces")
    cfg = engine_config(tiny_model)
    assert cfg.profiler_config.torch_profiler_dir == "/tmp/qaic-traces"


# -- engine arguments ------------------------------------------------------------------------------------
def test_engine_arguments(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from qaic_vllm.config import engine_settings

    monkeypatch.delenv("QAIC_ASYNC_SCHEDULING", raising=False)
    cfg = engine_config(
        tiny_model,
        quantization="mxfp6",
        kv_cache_dtype="mxint8",  # offline LLM(...) takes vllm-qaic's name too
        long_prefill_token_threshold=64,
        gpu_memory_utilization=0.5,
        enforce_eager=False,
        async_scheduling=True,
        tensor_parallel_size=2,
    )
    s = engine_settings(cfg).compile
    assert (s.mxfp6, s.mxint8, s.prefill_seq_len, s.num_devices) == (True, True, 64, 2)
    assert (s.full_batch_size, s.ctx_len) == (4, 256)
    assert cfg.parallel_config.tensor_parallel_size == 1 and cfg.parallel_config.world_size == 1
    assert cfg.scheduler_config.async_scheduling is True  # --async-scheduling alone turns it on
    assert engine_config(tiny_model, async_scheduling=False).scheduler_config.async_scheduling is False
    with pytest.raises((QaicConfigError, ValueError), match="disagree"):
        engine_config(
            tiny_model, tensor_parallel_size=2, additional_config={"override_qaic_config": {"num_devices": 4}}
        )


def test_every_engine_argument_has_a_case() -> None:
    covered = {
        "--quantization",
        "--kv-cache-dtype",
        "--long-prefill-token-threshold",
        "--gpu-memory-utilization",
    }
    covered |= {"--enforce-eager", "--async-scheduling", "--tensor-parallel-size", "--max-num-seqs"}
    covered |= {"--max-model-len", "--additional-config", "--enable-mm-embeds"}
    covered |= {"--speculative-config"}  # test_spec_target_variables, test_spec_draft_variables
    covered |= {"--runner"}  # test_vllm_pooling*.py
    assert covered == set(vendor.ENGINE_ARGS)


# -- defaults sized to the device -------------------------------------------------------------------------
LLAMA_2_7B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "torch_dtype": "float16",
}


@pytest.fixture(scope="module")
def llama_7b_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama-2-7B's config.json without weights: enough to size a program (nothing is compiled)."""
    from qaic_vllm.default_model import build_tokenizer

    model = tmp_path_factory.mktemp("llama-2-7b-config") / "llama-2-7b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA_2_7B))
    build_tokenizer(model, 300)
    return model


@pytest.fixture
def simulated(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[SkuType], None]]:
    from qaic_sim.config import SimConfig
    from qaic_sim.machine import SimMachine, reset_machine

    def use(sku: SkuType) -> None:
        reset_machine(SimMachine(SimConfig(cards=(sku,))))

    yield use
    reset_machine()


@pytest.mark.parametrize("sku", list(SkuType))
def test_unflagged_start_chooses_a_shape_that_fits(
    llama_7b_config: Path,
    simulated: Callable[[SkuType], None],
    sku: SkuType,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from qaic_aot import memory
    from qaic_core.types import SKUS
    from qaic_vllm.config import engine_settings

    simulated(sku)
    with caplog.at_level("INFO", logger="qaic.vllm"):
        cfg = EngineArgs(model=str(llama_7b_config), dtype="float16").create_engine_config()
    s = engine_settings(cfg).compile
    spec = SKUS[sku]
    assert s.num_cores == spec.nsp_per_soc  # from the device (nspTotal)
    assert (cfg.scheduler_config.max_num_seqs, cfg.model_config.max_model_len) == (
        s.full_batch_size,
        s.ctx_len,
    )
    need = memory.program_memory(memory.dims_from_config(LLAMA_2_7B), s).per_device
    assert need <= spec.dram_mb_per_soc * 2**20 * (1 - memory.AUTO_HEADROOM)
    assert 1 <= s.full_batch_size <= memory.AUTO_MAX_BATCH and s.ctx_len <= 4096
    chose = [r.getMessage() for r in caplog.records if "chose" in r.getMessage()]
    assert chose and "--max-num-seqs and --max-model-len not given" in chose[0] and sku.value in chose[0]


def test_a_request_too_large_fails_before_compiling(
    llama_7b_config: Path, simulated: Callable[[SkuType], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    import qaic_aot.compile

    def no_compile(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("compiled although the shape cannot fit")

    monkeypatch.setattr(qaic_aot.compile, "compile_model", no_compile)
    simulated(SkuType.PRO)
    with pytest.raises((QaicConfigError, ValueError)) as info:
        EngineArgs(
            model=str(llama_7b_config), dtype="float16", max_num_seqs=64, max_model_len=4096
        ).create_engine_config()
    text = str(info.value)
    assert "full_batch_size=64 (--max-num-seqs) at ctx_len=4096 (--max-model-len) needs" in text
    assert "the largest that fit: --max-num-seqs" in text and "at --max-num-seqs 64" in text
    # The largest named does start.
    largest = int(text.split("the largest that fit: --max-num-seqs ")[1].split()[0])
    cfg = EngineArgs(
        model=str(llama_7b_config), dtype="float16", max_num_seqs=largest, max_model_len=4096
    ).create_engine_config()
    assert cfg.scheduler_config.max_num_seqs == largest


AI080_CHILD = textwrap.dedent(
    """
    import sys
    from vllm import LLM, SamplingParams

    llm = LLM(model=sys.argv[1], kv_cache_dtype="mxint8", quantization="mxfp6")
    config = llm.llm_engine.vllm_config
    out = llm.generate(["Hello there"], SamplingParams(max_tokens=4, temperature=0))
    print("shape", config.scheduler_config.max_num_seqs, config.model_config.max_model_len)
    print("tokens", len(out[0].outputs[0].token_ids))
    """
)


def test_default_start_serves_on_a_simulated_ai080_ultra(tiny_model: Path, qeff_home: Path) -> None:
    """No --max-num-seqs, --max-model-len or num_cores: 8 NSPs per SoC, a shape that fits, and it serves."""
    env = {**os.environ, "QAIC_SIM_TOPOLOGY": "ai080-ultra", "QEFF_HOME": str(qeff_home)}
    done = subprocess.run(
        [sys.executable, "-c", AI080_CHILD, str(tiny_model)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tokens 4" in done.stdout
    assert "-aic-num-cores=8" in done.stderr
    assert "shape 16 512" in done.stdout  # the tiny model's full context, 16 sequences


def test_docs_carry_the_vendor_tables() -> None:
    text = (Path(__file__).resolve().parents[3] / "docs" / "configuration.md").read_text()
    assert vendor.vendor_tables() in text, (
        "docs/configuration.md's vllm-qaic tables are stale; paste the output of "
        "python -c 'from qaic_vllm.vendor import vendor_tables; print(vendor_tables())'"
    )
