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


def test_greedy_output_equals_transformers(
    llm: Any, hf_greedy: Callable[[Sequence[int], int], list[int]]
) -> None:
    outs = llm.generate(TEXTS, greedy(24))
    for ids, out in zip(prompt_ids(llm, TEXTS), outs, strict=True):
        assert list(out.outputs[0].token_ids) == hf_greedy(ids, 24)


def test_steps_mix_prefill_chunks_with_decodes(llm: Any, steps: StepRecorder) -> None:
    steps.steps.clear()
    llm.generate(
        [f"Step {i}: {text}" for i, text in enumerate(reversed(TEXTS))], greedy(8)
    )  # no cached prefix
    assert any(s.decode_rows > 0 and s.prefill_tokens > 0 for s in steps.steps), steps.steps
    assert max(s.prefill_tokens + s.decode_rows for s in steps.steps) <= 32


def test_logprobs_stay_with_their_request_while_others_prefill(llm: Any, hf_logprobs: Any) -> None:
    from vllm import SamplingParams

    texts = [f"Logprobs {i}: {text}" for i, text in enumerate(TEXTS)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    outs = llm.generate(texts, params)
    for ids, out in zip(prompt_ids(llm, texts), outs, strict=True):
        generated = list(out.outputs[0].token_ids)
        reference = hf_logprobs([*ids, *generated])
        for j, token in enumerate(generated):
            got = out.outputs[0].logprobs[j][token].logprob
            assert abs(got - float(reference[len(ids) + j - 1, token])) < 1e-3, (j, token)


# The tests below start engines of their own; an engine that shuts down takes vLLM's process groups
# with it, so every test of the module's engine comes before them.
def counter(llm: Any, name: str) -> float:
    """A vLLM metric summed over its labels (counters are process-wide: compare before and after)."""
    return float(sum(getattr(m, "value", 0) or 0 for m in llm.get_metrics() if m.name == name))


SYSTEM = (
    "You are a careful assistant that runs on a small card in a quiet rack. Answer briefly, say what you "
    "do not know, and never make up a number. "
)
QUESTIONS = ["What is the weather", "Tell me a story about", "Why is the sky", "Count from one to"]


def test_a_shared_prefix_hits_the_cache_and_changes_no_token(
    llm: Any, tiny_model: Path, hf_greedy: Callable[[Sequence[int], int], list[int]]
) -> None:
    texts = [SYSTEM + q for q in QUESTIONS]
    ids = prompt_ids(llm, texts)
    hits = counter(llm, "vllm:prefix_cache_hits")
    first = llm.generate(texts[:1], greedy(16))
    rest = llm.generate(texts[1:], greedy(16))
    shared = len(prompt_ids(llm, [SYSTEM])[0]) // 16 * 16
    assert counter(llm, "vllm:prefix_cache_hits") - hits >= 3 * shared > 0
    cached = [list(o.outputs[0].token_ids) for o in [*first, *rest]]
    assert cached == [hf_greedy(i, 16) for i in ids]
    uncached = make_llm(tiny_model, enable_prefix_caching=False)
    try:
        assert not uncached.llm_engine.vllm_config.cache_config.enable_prefix_caching
        outs = uncached.generate(texts, greedy(16))
        assert [list(o.outputs[0].token_ids) for o in outs] == cached
    finally:
        del uncached
        gc.collect()


def test_more_requests_than_kv_blocks_are_preempted_recomputed_and_correct(
    tiny_model: Path, in_process: None, hf_greedy: Callable[[Sequence[int], int], list[int]]
) -> None:
    small = make_llm(tiny_model, max_model_len=128, num_gpu_blocks_override=12, max_num_batched_tokens=64)
    try:
        preempted = counter(small, "vllm:num_preemptions")
        outs = small.generate(TEXTS[:4], greedy(60))
        assert counter(small, "vllm:num_preemptions") > preempted
        for ids, out in zip(prompt_ids(small, TEXTS[:4]), outs, strict=True):
            assert list(out.outputs[0].token_ids) == hf_greedy(ids, 60)
    finally:
        del small
        gc.collect()
