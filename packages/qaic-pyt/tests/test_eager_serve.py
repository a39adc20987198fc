"""A real ``vllm serve`` in the eager mode, driven by the official openai client, for representative architectures.

Llama (the common decoder), Gemma 2 (sliding windows and soft-capping), GPT-2 (learned positions,
biases) and Qwen3-MoE (experts in plain torch): completions and chat give transformers' greedy
tokens, streaming gives the same tokens, and a shared prefix shows up as prefix-cache hits in the
server's own /metrics.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from eager_models import HFGreedy, build_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "qaic-vllm" / "tests"))
from vllm_server import VllmServer

pytestmark = pytest.mark.serve

MODEL = "tiny"
PROMPTS = [
    "Hello world! How are you today?",
    "Once upon a time there was a small decoder that predicted the next token greedily, block after block",
    "Numbers like 0 1 2 3",
]
SYSTEM = (
    "Prefix caching lets requests that share a system prompt reuse its blocks instead of computing them "
    "again, block after block. "
)


def completion(client: Any, prompt: Any, max_tokens: int, **kwargs: Any) -> Any:
    return client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
        **kwargs,
    )


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt2", "qwen3_moe"])
def test_serve_matches_transformers(arch: str, models_root: Path, tmp_path: Path) -> None:
    import openai
    from transformers import AutoTokenizer

    model_dir = build_tiny_model(arch, models_root)
    tok = AutoTokenizer.from_pretrained(model_dir)
    ref = HFGreedy(model_dir)
    args = [
        "--served-model-name", MODEL,
        "--max-model-len", "256",
        "--max-num-seqs", "4",
        "--max-num-batched-tokens", "32",
        "--dtype", "float32",
    ]  # fmt: skip
    server = VllmServer(model_dir, args, tmp_path / "vllm-serve.log", env={"VLLM_QAIC_EXECUTION_MODE": "pyt"})
    try:
        assert "pyt execution mode" in server.log_text()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=300, max_retries=0)
        for text in PROMPTS:
            choice = completion(client, text, 10).choices[0]
            assert choice.prompt_token_ids == tok(text)["input_ids"]
            assert choice.token_ids == ref(choice.prompt_token_ids, 10), (arch, text)

        messages = [{"role": "user", "content": "What is the capital of France?"}]
        chat = client.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert getattr(chat, "prompt_token_ids", None) in (None, ids)
        assert chat.choices[0].token_ids == ref(ids, 8)

        stream = client.completions.create(
            model=MODEL,
            prompt=PROMPTS[1],
            max_tokens=10,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        assert streamed == completion(client, PROMPTS[1], 10).choices[0].text

        hits = server.metric("vllm:prefix_cache_hits_total")
        for question in ("Why?", "How?", "When?"):
            completion(client, SYSTEM + question, 4)
        assert server.metric("vllm:prefix_cache_hits_total") - hits >= 2 * 16
    finally:
        server.stop()
