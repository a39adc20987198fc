"""vLLM on the aot path serves architectures exported by tracing transformers' code, token for token.

Each engine compiles a tiny random model of one family (qaic-aot's test models) and its greedy output
must equal transformers' over more prompts than KV slots and prompts longer than a prefill chunk.
"""

from __future__ import annotations

import gc
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest


def _aot_models() -> ModuleType:
    """qaic-aot's tiny model builders, loaded by path (both test folders have a conftest module)."""
    name = "qaic_aot_test_models"
    if name in sys.modules:
        return sys.modules[name]
    path = Path(__file__).parents[2] / "qaic-aot" / "tests" / "models.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


NOT_IN_VLLM = {"mpt": "vLLM dropped MptForCausalLM after v0.28 and refuses it before any platform runs"}
"""Families qaic-aot compiles that this vLLM does not accept at all (qaic-aot generate serves them)."""
ARCHS = tuple(a for a in _aot_models().TRACED_ARCHS if a not in NOT_IN_VLLM)
"""Every family qaic-aot exports by tracing (its tests' TRACED_ARCHS) that vLLM accepts, one engine each."""
ENGINE_ARGS: dict[str, Any] = {
    "max_model_len": 64,
    "max_num_seqs": 4,
    "long_prefill_token_threshold": 8,
    "dtype": "float32",
    "additional_config": {"execution_mode": "aot", "override_qaic_config": {"num_cores": 4}},
}
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def models() -> ModuleType:
    return _aot_models()


@pytest.fixture
def engine_of(qeff_home: Path, tmp_path_factory: pytest.TempPathFactory, models: ModuleType) -> Iterator[Any]:
    """``start(arch) -> (LLM, reference)``; the engine is torn down after the test."""
    import vllm.envs
    from vllm import LLM

    made: list[Any] = []

    def start(arch: str) -> tuple[Any, Any]:
        model_dir = models.build_tiny_model(arch, tmp_path_factory.mktemp(f"vllm-{arch}"))
        made.append(LLM(model=str(model_dir), seed=0, **ENGINE_ARGS))
        return made[-1], models.HFReference(model_dir)

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        mp.setenv("QAIC_AOT_EXPORTER", "qaic")
        yield start
        made.clear()
        gc.collect()
    vllm.envs.disable_envs_cache()


@pytest.mark.parametrize("arch", ARCHS)
def test_traced_architecture_serves_greedy_like_transformers(
    arch: str, engine_of: Any, models: ModuleType, qeff_home: Path
) -> None:
    from vllm import SamplingParams

    llm, ref = engine_of(arch)
    prompts = models.more_prompts(ref.tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outs, strict=True):
        expected = ref.greedy(prompt, MAX_TOKENS)
        got = list(out.outputs[0].token_ids)
        # HF's generate stops at EOS; vLLM was told to ignore it, so compare up to the reference's length.
        assert got[: len(expected)] == expected
    programs = list(qeff_home.glob(f"{ref.model.config.architectures[0]}/*/qpc-*/qpc/programqpc.bin"))
    assert programs, "the engine did not compile an aot program"


def test_every_traced_family_is_served(models: ModuleType, tmp_path: Path) -> None:
    """Only the families vLLM itself refuses are left out, and it does refuse them (naming them)."""
    from vllm.engine.arg_utils import EngineArgs

    assert set(ARCHS) | set(NOT_IN_VLLM) == set(models.TRACED_ARCHS)
    for arch in NOT_IN_VLLM:
        model_dir = models.build_tiny_model(arch, tmp_path / arch)
        architecture = models.HFReference(model_dir).model.config.architectures[0]
        with pytest.raises(Exception, match=f"{architecture} was supported in vLLM until"):
            EngineArgs(model=str(model_dir)).create_model_config()
