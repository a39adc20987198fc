"""Prefill without padding waste: shorter compiled chunks and a batched prefill for bursts of short prompts."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from test_vllm_offline import StepRecorder, as_prompts, greedy, in_process_llm, registered_recorder, worker_of

from qaic_core.execution import BATCHED_PREFILL
from qaic_vllm.prefill import auto_lengths, prefill_shapes

CHUNK = 32
ENGINE_ARGS: dict[str, Any] = {
    "max_model_len": 128,
    "max_num_seqs": 4,
    "long_prefill_token_threshold": CHUNK,
    "dtype": "float32",
    "additional_config": {
        "override_qaic_config": {"num_cores": 4, "prefill_seq_lens": [8, 16], "prefill_batch_size": 3}
    },
}


def test_automatic_prefill_shapes() -> None:
    assert auto_lengths(128) == (32, 64) and auto_lengths(256) == (64, 128) and auto_lengths(32) == ()
    assert prefill_shapes({}, 128, 8, prebuilt=False) == prefill_shapes({}, 128, 8, False)
    shapes = prefill_shapes({}, 128, 8, prebuilt=False)
    assert (shapes.seq_lens, shapes.batch_size, shapes.batch_seq_len) == ((32, 64), 4, 32)
    assert prefill_shapes({}, 128, 2, False).batch_size == 2  # never more rows than KV slots
    assert prefill_shapes({}, 128, 8, prebuilt=True).seq_lens == ()  # a prebuilt QPC keeps its shapes
    assert prefill_shapes({}, 16, 8, False).batch_size == 1
    given = prefill_shapes({"prefill_seq_lens": (8, 32), "prefill_batch_size": 2}, 32, 4, False)
    assert (given.seq_lens, given.batch_size) == ((8,), 2)


@pytest.fixture(scope="module")
def steps() -> Iterator[StepRecorder]:
    with registered_recorder("test-prefill-step-recorder") as recorder:
        yield recorder


@pytest.fixture(scope="module")
def llm(tiny_model: Path, steps: StepRecorder) -> Iterator[Any]:
    with in_process_llm(tiny_model, ENGINE_ARGS) as engine:
        yield engine


def test_the_program_has_the_prefill_shapes(llm: Any) -> None:
    model = worker_of(llm).step_model
    assert BATCHED_PREFILL in model.capabilities
    shape = model.shape
    assert (shape.prefill_seq_lens, shape.prefill_batch_size, shape.prefill_batch_seq_len) == (
        (8, 16, 32),
        3,
        8,
    )
    assert [shape.prefill_length(n) for n in (1, 8, 9, 17, 32)] == [8, 8, 16, 32, 32]


def test_a_burst_of_short_prompts_is_prefilled_together(
    llm: Any, hf_greedy: Callable[..., list[int]], steps: StepRecorder
) -> None:
    tok = llm.get_tokenizer()
    texts = ["Hello there", "The weather", "A small model", "Rivers flow", "Once upon a time"]
    prompts = [tok(t, add_special_tokens=False)["input_ids"][:8] for t in texts]
    steps.steps.clear()
    outs = llm.generate(as_prompts(prompts), greedy(10))
    for prompt, out in zip(prompts, outs, strict=True):
        assert list(out.outputs[0].token_ids) == hf_greedy(prompt, 10)
    first = steps.steps[0]
    # Three short prompts started in the first step, in one batched run of 3 rows x 8 tokens.
    assert first.prefill_tokens == sum(len(p) for p in prompts[:3])
    assert (first.prefill_runs, first.prefill_computed) == (1, 3 * 8)
    assert max(s.prefill_tokens for s in steps.steps) <= CHUNK


def test_a_smaller_burst_runs_on_fewer_rows(
    llm: Any, hf_greedy: Callable[..., list[int]], steps: StepRecorder
) -> None:
    tok = llm.get_tokenizer()
    prompts = [tok(t, add_special_tokens=False)["input_ids"][:8] for t in ("Two rivers", "A quiet town")]
    assert worker_of(llm).step_model.shape.prefill_batch_sizes == (2, 3)
    steps.steps.clear()
    outs = llm.generate(as_prompts(prompts), greedy(6))
    for prompt, out in zip(prompts, outs, strict=True):
        assert list(out.outputs[0].token_ids) == hf_greedy(prompt, 6)
    # Two short prompts: one batched run of 2 rows x 8 tokens, not 3 rows with one of padding.
    first = steps.steps[0]
    assert (first.prefill_tokens, first.prefill_runs, first.prefill_computed) == (
        sum(len(p) for p in prompts),
        1,
        2 * 8,
    )


def test_a_long_prompt_uses_the_full_chunk_and_its_tail_a_short_one(
    llm: Any, hf_greedy: Callable[..., list[int]], steps: StepRecorder
) -> None:
    tok = llm.get_tokenizer()
    prompt = tok("Questions and answers. What is the capital of France? " * 3, add_special_tokens=False)[
        "input_ids"
    ][:40]
    steps.steps.clear()
    out = llm.generate(as_prompts([prompt]), greedy(6))[0]
    assert list(out.outputs[0].token_ids) == hf_greedy(prompt, 6)
    prefills = [(s.prefill_tokens, s.prefill_computed) for s in steps.steps if s.prefill_tokens]
    tail = len(prompt) - CHUNK
    assert 0 < tail <= 8
    assert prefills == [(CHUNK, CHUNK), (tail, 8)]  # one full chunk, then the tail on the 8-token prefill
    decodes = [s for s in steps.steps if s.decode_rows]
    assert all(s.decode_computed == 4 and s.decode_tokens == s.decode_rows for s in decodes)
