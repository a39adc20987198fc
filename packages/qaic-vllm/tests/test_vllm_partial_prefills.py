"""Several prompts in prefill at once (max_num_partial_prefills) and a batched prefill of long rows."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from test_vllm_offline import StepRecorder, as_prompts, greedy, in_process_llm, registered_recorder, worker_of

CHUNK = 32
ENGINE_ARGS: dict[str, Any] = {
    "max_model_len": 128,
    "max_num_seqs": 4,
    "long_prefill_token_threshold": CHUNK,
    "dtype": "float32",
    "additional_config": {
        "override_qaic_config": {
            "num_cores": 4,
            "prefill_seq_lens": [16],
            "prefill_batch_size": 2,
            "prefill_batch_seq_len": CHUNK,
            "max_num_partial_prefills": 4,
        }
    },
}


@pytest.fixture(scope="module")
def steps() -> Iterator[StepRecorder]:
    with registered_recorder("test-partial-prefill-recorder") as recorder:
        yield recorder


@pytest.fixture(scope="module")
def llm(tiny_model: Path, steps: StepRecorder) -> Iterator[Any]:
    with in_process_llm(tiny_model, ENGINE_ARGS) as engine:
        yield engine


def _generate_as_transformers(
    llm: Any, hf_greedy: Callable[..., list[int]], steps: StepRecorder, n: int, length: int, new: int
) -> None:
    """``n`` prompts of ``length`` tokens generated together; each output equals transformers' greedy one."""
    tok = llm.get_tokenizer()
    text = "Questions and answers about rivers, mountains, cities and the weather of the world. " * 4
    ids = tok(text, add_special_tokens=False)["input_ids"]
    prompts = [ids[i : i + length] for i in range(n)]
    steps.steps.clear()
    outs = llm.generate(as_prompts(prompts), greedy(new))
    for prompt, out in zip(prompts, outs, strict=True):
        assert list(out.outputs[0].token_ids) == hf_greedy(prompt, new)


def test_the_batched_prefill_has_rows_of_the_full_chunk(llm: Any) -> None:
    shape = worker_of(llm).step_model.shape
    assert (shape.prefill_batch_size, shape.prefill_batch_seq_len) == (2, CHUNK)
    assert shape.prefill_seq_lens == (16, CHUNK)


def test_every_free_slot_starts_a_prompt_in_one_step(
    llm: Any, hf_greedy: Callable[..., list[int]], steps: StepRecorder
) -> None:
    _generate_as_transformers(llm, hf_greedy, steps, 4, 27, 8)
    first = steps.steps[0]
    # All four prompts start in the first step, two rows of 32 tokens per batched run.
    assert first.prefill_tokens == 4 * 27
    assert (first.prefill_runs, first.prefill_computed) == (2, 4 * CHUNK)


def test_long_prompts_are_fed_a_chunk_each_per_step(
    llm: Any, hf_greedy: Callable[..., list[int]], steps: StepRecorder
) -> None:
    _generate_as_transformers(llm, hf_greedy, steps, 3, 45, 6)
    prefills = [s.prefill_tokens for s in steps.steps if s.prefill_tokens]
    # Three prompts in prefill together: a full chunk each, then their 13-token tails.
    assert prefills == [3 * CHUNK, 3 * (45 - CHUNK)]
    assert max(s.prefill_runs for s in steps.steps) == 2  # two rows batched, the third alone
