"""``LLM.embed`` in-process with a decoder used as an embedder (Qwen2Model, last-token pooling)."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

CTX = 64
BATCH = 2
PROMPTS = [[5, 17, 9], list(range(20, 60)), [101], list(range(3, 14)), [7, 7, 7, 7, 7]]


@pytest.fixture(scope="module")
def llm(qwen2_embedder: tuple[Path, Any], qeff_home: Path) -> Iterator[Any]:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    engine = LLM(
        model=str(qwen2_embedder[0]),
        runner="pooling",
        max_model_len=CTX,
        max_num_seqs=BATCH,
        dtype="float32",
        additional_config={"override_qaic_config": {"num_cores": 4, "embed_seq_len": [8, 32, CTX]}},
    )
    yield engine
    del engine
    gc.collect()
    os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)


def test_decoder_embeddings_are_the_last_token_normalized(llm: Any, qwen2_embedder: tuple[Path, Any]) -> None:
    import torch

    _, model = qwen2_embedder
    outputs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS])
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        with torch.no_grad():
            last = model(torch.tensor([prompt])).last_hidden_state[0, -1].numpy()
        expected = last / np.linalg.norm(last)
        np.testing.assert_allclose(np.asarray(output.outputs.embedding), expected, atol=1e-5)


def test_a_pooling_model_does_not_generate(llm: Any) -> None:
    with pytest.raises(Exception, match=r"(?i)generat|pooling|runner"):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}])
