"""Every architecture the eager path lists: vLLM's own class through ``LLM`` gives transformers' greedy tokens.

Each tiny random-weight model runs in fp32 on the simulator with small KV blocks and a small
per-step token budget, so prompts run in several chunks beside the decodes of other requests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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


# vLLM runs several families (Gemma, OLMo 2, ...) through its Transformers backend, which decorates
# transformers' own model classes for the life of the process. Each engine therefore runs in a child
# process, so later tests in this process build and run those families with transformers unchanged.
_CHILD = """
import json, sys
from vllm import LLM, SamplingParams
args = json.loads(sys.argv[1])
llm = LLM(
    model=args["model"],
    seed=0,
    dtype="float32",
    max_model_len=256,
    max_num_seqs=4,
    max_num_batched_tokens=24,
    additional_config={"execution_mode": "pyt"},
)
outs = llm.generate(
    [{"prompt_token_ids": p} for p in args["prompts"]],
    SamplingParams(max_tokens=args["new_tokens"], temperature=0.0, ignore_eos=True),
)
print("TOKENS " + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""


def _vllm_greedy(model_dir: Path, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    args = json.dumps({"model": str(model_dir), "prompts": prompts, "new_tokens": new_tokens})
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, args], env=env, capture_output=True, text=True, timeout=900
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("TOKENS ")]
    assert done.returncode == 0 and lines, (
        f"the engine failed (exit {done.returncode}):\n{done.stderr[-4000:]}"
    )
    tokens: list[list[int]] = json.loads(lines[-1].removeprefix("TOKENS "))
    return tokens


def test_every_listed_architecture_has_a_tiny_model_here() -> None:
    assert set(ARCHITECTURES.values()) == SUPPORTED
    assert set(ARCHITECTURES) == set(CONFIGS)


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_greedy_tokens_equal_transformers(arch: str, models_root: Path) -> None:
    from transformers import AutoTokenizer

    model_dir = build_tiny_model(arch, models_root)
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    ref = HFGreedy(model_dir)
    expected = [ref(p, NEW_TOKENS) for p in prompts]
    got = _vllm_greedy(model_dir, prompts, NEW_TOKENS)
    for prompt, want, tokens in zip(prompts, expected, got, strict=True):
        assert tokens == want, (arch, len(prompt))
