"""Compute-context lengths through vLLM: vllm-qaic's override keys compile them in, output is unchanged."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from vllm.engine.arg_utils import EngineArgs

from qaic_core.errors import QaicConfigError

ENGINE_ARGS: dict[str, Any] = {
    "max_model_len": 256,
    "max_num_seqs": 4,
    "long_prefill_token_threshold": 16,
    "dtype": "float32",
}
CCL_OVERRIDES = {
    "num_cores": 4,
    "ccl_enabled": True,
    "comp_ctx_lengths_prefill": [32, 64],
    "comp_ctx_lengths_decode": "32,64,128",
}
TEXTS = [
    "Hello world, what is",
    "Once upon a time there was a small language model. It lived on a tiny card in a quiet rack of "
    "servers, and every day it answered questions about rivers, mountains, bread and the weather",
    "The weather",
]


def test_greedy_output_with_ccl_equals_transformers(
    tiny_model: Path, qeff_home: Path, hf_greedy: Callable[[Sequence[int], int], list[int]]
) -> None:
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    prompts = [tokenizer(t)["input_ids"] for t in TEXTS]
    assert max(len(p) for p in prompts) > 32  # a prefill crosses from the 32 to the 64 length
    new_tokens = 48  # decodes cross 32 and 64
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        llm = LLM(
            model=str(tiny_model),
            seed=0,
            additional_config={"override_qaic_config": CCL_OVERRIDES},
            **ENGINE_ARGS,
        )
        try:
            params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm
    for prompt, output in zip(prompts, outputs, strict=True):
        assert list(output.outputs[0].token_ids) == hf_greedy(prompt, new_tokens)
    served = [
        [(s["name"], s["symbols"]["comp_ctx_lengths"]) for s in json.loads(f.read_text())["specializations"]]
        for f in qeff_home.rglob("specializations.json")
        if "comp_ctx_lengths" in f.read_text()
    ]
    assert served[0][:3] == [("Prefill", "32"), ("Prefill", "64"), ("Prefill", "256")]
    assert [("Decode", c) for c in ("32", "64", "128", "256")] == served[0][3:]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"comp_ctx_lengths_decode": [64, 512]}, r"comp_ctx_lengths_decode \[64, 512\]: 512 exceeds ctx_len \(256"),
        ({"comp_ctx_lengths_prefill": [128, 64]}, r"comp_ctx_lengths_prefill \[128, 64\] is not ascending"),
    ],
)  # fmt: skip
def test_a_bad_list_is_refused_at_configuration(
    tiny_model: Path, override: dict[str, Any], message: str
) -> None:
    from qaic_vllm.config import engine_settings

    with pytest.raises((QaicConfigError, ValueError), match=message) as info:
        config = EngineArgs(
            model=str(tiny_model),
            additional_config={"override_qaic_config": {"num_cores": 4, **override}},
            **ENGINE_ARGS,
        ).create_engine_config()
        engine_settings(config)
    assert "override_qaic_config" in str(info.value)
