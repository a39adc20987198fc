"""Shared fixtures: a tiny random Llama built locally and greedy references from transformers."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

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


@pytest.fixture(scope="session")
def qeff_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh compile cache for the session (the QPC cache lives under QEFF_HOME)."""
    home = tmp_path_factory.mktemp("qeff")
    os.environ["QEFF_HOME"] = str(home)
    return home


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory, qeff_home: Path) -> Path:
    """A 2-layer random Llama with the package's tokenizer and chat template."""
    from qaic_vllm.default_model import build_model

    return build_model(tmp_path_factory.mktemp("models") / "tiny-llama", seed=1, **TINY_CONFIG)


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


@pytest.fixture(scope="session")
def qwen2_embedder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A tiny random Qwen2Model with the package's tokenizer (vLLM's pooling path wants one)."""
    import torch
    import transformers

    from qaic_vllm.default_model import build_tokenizer

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("models") / "tiny-qwen2-embedder"
    tokenizer = build_tokenizer(out)
    config = transformers.Qwen2Config(
        vocab_size=max(len(tokenizer), 160),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    model = transformers.Qwen2Model(config).eval()
    model.save_pretrained(out)
    return out, model


@pytest.fixture(scope="session")
def hf_logprobs(tiny_model: Path) -> Callable[[Sequence[int]], list[float]]:
    """``lp(ids)``: log-softmax of the next token after every prefix ``ids[:i]`` (i >= 1), per position."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()

    def lp(ids: Sequence[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([list(ids)])).logits[0], dim=-1)

    return lp  # type: ignore[return-value]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    """Attach the tail of the ``vllm serve`` log to every failing server test."""
    outcome = yield
    report = outcome.get_result()
    server = getattr(item, "funcargs", {}).get("server")
    if report.failed and server is not None:
        report.sections.append(("vllm serve log (tail)", server.log_tail()))
