"""Asynchronous scheduling: the next step is scheduled while the device runs this one; the output is the same."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_vllm_offline import TEXTS, as_prompts, worker_of

ENGINE_ARGS: dict[str, Any] = {
    "max_model_len": 128,
    "max_num_seqs": 3,
    "long_prefill_token_threshold": 16,
    "dtype": "float32",
    "additional_config": {"override_qaic_config": {"num_cores": 4}},
}


def _generate(model: Path, async_scheduling: bool, prompts: list[Any], params: list[Any]) -> list[Any]:
    import vllm.envs
    from vllm import LLM

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        mp.setenv("QAIC_ASYNC_SCHEDULING", "1")
        llm = LLM(model=str(model), seed=0, async_scheduling=async_scheduling, **ENGINE_ARGS)
        try:
            assert llm.llm_engine.vllm_config.scheduler_config.async_scheduling is async_scheduling
            assert worker_of(llm).runner.async_scheduling is async_scheduling
            outs = llm.generate(prompts, params)
        finally:
            del llm
            gc.collect()
    vllm.envs.disable_envs_cache()
    return [[(list(o.token_ids), o.text, o.finish_reason) for o in out.outputs] for out in outs]


@pytest.fixture(scope="module")
def workload(tiny_model: Path) -> Iterator[tuple[list[Any], list[Any]]]:
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    prompts = as_prompts([*ids, (ids[1] * 3)[:70], ids[0]])
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),  # finishes while others decode
        SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=9, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=9, n=2, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[5, 6, 7]),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
        SamplingParams(  # structured output: vLLM defers the step's sampling until the grammar is known
            temperature=1.0,
            seed=2,
            max_tokens=12,
            structured_outputs=StructuredOutputsParams(regex=r"(red|green|blue) [0-9]{2}"),
        ),
    ]
    yield prompts, params


def test_async_scheduling_gives_the_same_output(
    tiny_model: Path, workload: tuple[list[Any], list[Any]]
) -> None:
    prompts, params = workload
    sync = _generate(tiny_model, False, prompts, params)
    overlapped = _generate(tiny_model, True, prompts, params)
    assert overlapped == sync
    assert all(len(tokens) > 0 for out in sync for tokens, _, _ in out)
