"""The eager (pyt) execution mode through ``LLM``: vLLM's own Llama class over a paged KV cache on the simulator."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from qaic_core import get_plugin_manager, hookimpl
from qaic_core.observe import Observer, StepRecord

CTX = 256
EAGER: dict[str, Any] = {
    "max_model_len": CTX,
    "max_num_seqs": 4,
    "dtype": "float32",
    "max_num_batched_tokens": 32,  # long prompts run in chunks beside the decodes of others
    "additional_config": {"execution_mode": "pyt"},
    "disable_log_stats": False,
}
TEXTS = [
    "Hello world, what is",
    "Once upon a time there was a small language model. It lived on a tiny card in a quiet rack, "
    "and every morning it woke up, read the prompts that were waiting in the queue",
    "The weather",
    "A",
    "Questions and answers. What is the capital of France?",
    "A recipe for bread: mix five hundred grams of flour with ten grams of salt",
]


def worker_of(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker


class StepRecorder(Observer):
    def __init__(self) -> None:
        self.steps: list[StepRecord] = []

    def step(self, record: StepRecord) -> None:
        self.steps.append(record)

    @hookimpl
    def qaic_observers(self) -> list[Observer]:
        return [self]


@pytest.fixture(scope="module")
def steps() -> Iterator[StepRecorder]:
    recorder = StepRecorder()
    pm = get_plugin_manager()
    pm.register(recorder, name="test-eager-step-recorder")
    yield recorder
    pm.unregister(name="test-eager-step-recorder")


def make_llm(model: Path, **overrides: Any) -> Any:
    from vllm import LLM

    return LLM(model=str(model), seed=0, **{**EAGER, **overrides})


@pytest.fixture(scope="module")
def in_process() -> Iterator[None]:
    import vllm.envs

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        yield
    vllm.envs.disable_envs_cache()


@pytest.fixture(scope="module")
def llm(tiny_model: Path, steps: StepRecorder, in_process: None) -> Iterator[Any]:
    engine = make_llm(tiny_model)
    yield engine
    del engine
    gc.collect()


def greedy(max_tokens: int) -> Any:
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def prompt_ids(llm: Any, texts: Sequence[str]) -> list[list[int]]:
    tok = llm.get_tokenizer()
    return [tok(t)["input_ids"] for t in texts]


def test_the_eager_mode_runs_the_paged_worker_with_the_qaic_attention_backend(llm: Any) -> None:
    worker = worker_of(llm)
    assert type(worker).__name__ == "QaicPagedWorker"
    assert worker.path.name == "pyt"
    layers = worker.paged_model.layers
    assert {layer.attn_backend.__name__ for layer in layers.values()} == {"QaicPagedAttentionBackend"}
    cache = llm.llm_engine.vllm_config.cache_config
    assert cache.enable_prefix_caching
    assert cache.block_size == 16


def test_greedy_output_equals_transformers(llm: Any, hf_greedy: Callable[[Sequence[int], int], list[int]]) -> None:
    outs = llm.generate(TEXTS, greedy(24))
    for ids, out in zip(prompt_ids(llm, TEXTS), outs, strict=True):
        assert list(out.outputs[0].token_ids) == hf_greedy(ids, 24)


def test_steps_mix_prefill_chunks_with_decodes(llm: Any, steps: StepRecorder) -> None:
    steps.steps.clear()
    llm.generate([f"Step {i}: {text}" for i, text in enumerate(reversed(TEXTS))], greedy(8))  # no cached prefix
    assert any(s.decode_rows > 0 and s.prefill_tokens > 0 for s in steps.steps), steps.steps
    assert max(s.prefill_tokens + s.decode_rows for s in steps.steps) <= 32
