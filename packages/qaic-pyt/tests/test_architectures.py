"""Every architecture the eager path lists: vLLM's own class through ``LLM`` gives transformers' greedy tokens.

Each tiny random-weight model runs in fp32 on the simulator with small KV blocks and a small
per-step token budget, so prompts run in several chunks beside the decodes of other requests.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from eager_models import ARCHITECTURES, CONFIGS, HFGreedy, build_tiny_model

from qaic_pyt.plugin import ARCHITECTURES as SUPPORTED

TEXTS = [
    "Hello world! How are you today?",
    "Once upon a time there was a small decoder that predicted the next token greedily, block after block, "
    "and prefix caching lets requests that share a system prompt reuse its blocks",
    "The quick brown fox",
    "Numbers like 0 1 2 3 4 5 6 7 8 9 10 100 1000 appear in text",
]
NEW_TOKENS = 12


@pytest.fixture(scope="module", autouse=True)
def in_process() -> Iterator[None]:
    import vllm.envs

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        yield
    vllm.envs.disable_envs_cache()


def test_every_listed_architecture_has_a_tiny_model_here() -> None:
    assert set(ARCHITECTURES.values()) == SUPPORTED
    assert set(ARCHITECTURES) == set(CONFIGS)


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_greedy_tokens_equal_transformers(arch: str, models_root: Path) -> None:
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    model_dir = build_tiny_model(arch, models_root)
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    # The references first: vLLM's Transformers backend (Gemma, OLMo 2) rewires transformers' classes.
    ref = HFGreedy(model_dir)
    expected = [ref(p, NEW_TOKENS) for p in prompts]
    del ref
    llm: Any = LLM(
        model=str(model_dir),
        seed=0,
        dtype="float32",
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=24,
        additional_config={"execution_mode": "pyt"},
    )
    try:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True),
        )
        for prompt, want, out in zip(prompts, expected, outs, strict=True):
            assert list(out.outputs[0].token_ids) == want, (arch, len(prompt))
    finally:
        del llm
        gc.collect()
