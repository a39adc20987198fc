"""Fixtures for the end-to-end tests: tiny random Llamas built locally, transformers' greedy reference."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

os.environ.setdefault("QAIC_BACKEND", "sim")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

sys.path.insert(0, str(Path(__file__).parent))

TINY_CONFIG = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}
"""The qaic-vllm tests' model: head_dim 16."""
WIDE_HEAD_CONFIG = {**TINY_CONFIG, "hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1}
"""head_dim 64: an mxint8 KV cache of it travels compact (blocks of 32 values)."""


@pytest.fixture(scope="session")
def qeff_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One compile cache for the session: instances with the same shapes reuse one QPC."""
    home = tmp_path_factory.mktemp("qeff")
    os.environ["QEFF_HOME"] = str(home)
    return home


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory, qeff_home: Path) -> Path:
    from qaic_vllm.default_model import build_model

    return build_model(tmp_path_factory.mktemp("models") / "tiny-llama", seed=1, **TINY_CONFIG)


@pytest.fixture(scope="session")
def wide_head_model(tmp_path_factory: pytest.TempPathFactory, qeff_home: Path) -> Path:
    from qaic_vllm.default_model import build_model

    return build_model(tmp_path_factory.mktemp("models") / "tiny-llama-hd64", seed=2, **WIDE_HEAD_CONFIG)


@pytest.fixture(scope="session")
def hf_greedy(tiny_model: Path) -> Callable[[Sequence[int], int], list[int]]:
    """``ref(prompt_ids, n)``: transformers' greedy continuation of exactly ``n`` tokens (EOS ignored)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def ref(prompt_ids: Sequence[int], n: int) -> list[int]:
        key = (tuple(prompt_ids), n)
        if key not in cache:
            ids = list(prompt_ids)
            with torch.no_grad():
                for _ in range(n):
                    logits = model(torch.tensor([ids])).logits[0, -1]
                    ids.append(int(torch.argmax(logits)))
            cache[key] = ids[len(prompt_ids) :]
        return cache[key]

    return ref
