"""``vllm serve`` with speculative decoding, driven by the openai client with concurrent requests."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from vllm_server import VllmServer

pytestmark = pytest.mark.serve

FULL_BATCH = 4
MODEL = "tiny-spec"


def prompt_ids(i: int) -> list[int]:
    return [(11 * i + 5 * k) % 700 + 9 for k in range(4 + 7 * i)]


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    log = tmp_path_factory.mktemp("serve-spec") / "vllm-serve.log"
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    args = [
        "--served-model-name", MODEL,
        "--max-model-len", "256",
        "--max-num-seqs", str(FULL_BATCH),
        "--long-prefill-token-threshold", "16",
        "--dtype", "float32",
        "--speculative-config", json.dumps(spec),
    ]  # fmt: skip
    srv = VllmServer(tiny_model, args, log)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: VllmServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=300, max_retries=0)


def test_concurrent_greedy_requests_match_transformers(
    server: VllmServer, client: openai.OpenAI, hf_greedy: Callable[..., list[int]]
) -> None:
    n = 2 * FULL_BATCH

    def one(i: int) -> list[int]:
        reply = client.completions.create(
            model=MODEL,
            prompt=prompt_ids(i),
            max_tokens=40,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        return list(reply.choices[0].token_ids)

    with ThreadPoolExecutor(n) as pool:
        replies = list(pool.map(one, range(n)))
    for i, tokens in enumerate(replies):
        assert tokens == hf_greedy(prompt_ids(i), 40), f"request {i}"
    metrics = httpx.get(server.url + "/metrics", timeout=30).text
    accepted = [
        line for line in metrics.splitlines() if line.startswith("vllm:spec_decode_num_accepted_tokens")
    ]
    assert accepted and float(accepted[0].split()[-1]) > 0


def test_streaming_with_speculation_equals_the_whole_reply(client: openai.OpenAI) -> None:
    kwargs = {"model": MODEL, "prompt": prompt_ids(2), "max_tokens": 30, "temperature": 0}
    whole = client.completions.create(**kwargs, extra_body={"ignore_eos": True}).choices[0].text
    stream = client.completions.create(**kwargs, stream=True, extra_body={"ignore_eos": True})
    assert "".join(chunk.choices[0].text for chunk in stream) == whole
