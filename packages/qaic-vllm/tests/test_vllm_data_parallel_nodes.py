"""vLLM's multi-node data parallelism on qaic, as two "nodes" on 127.0.0.1 with disjoint simulated SoCs.

The first node serves the API and data-parallel rank 0 on SoC 0 (``QAIC_VISIBLE_DEVICES=0``); the
second runs rank 1 headless on SoC 1 (``QAIC_VISIBLE_DEVICES=1``). They share one compile cache.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from vllm_server import ServeProcess, VllmServer, free_port

pytestmark = pytest.mark.serve

MODEL = "tiny"
REQUESTS = 8
COMMON = [
    "--served-model-name", MODEL,
    "--max-model-len", "512",
    "--max-num-seqs", "4",
    "--long-prefill-token-threshold", "16",
    "--dtype", "float32",
    "--data-parallel-size", "2",
    "--data-parallel-size-local", "1",
    "--data-parallel-address", "127.0.0.1",
]  # fmt: skip


@pytest.fixture(scope="module")
def dp_qeff_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A compile cache of this file's own: the program these servers compile is the only one in it."""
    return tmp_path_factory.mktemp("qeff-dp")


@pytest.fixture(scope="module")
def nodes(
    tiny_model: Path, dp_qeff_home: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[VllmServer, ServeProcess]]:
    logs = tmp_path_factory.mktemp("serve-dp-nodes")
    rpc = ["--data-parallel-rpc-port", str(free_port())]
    second = ServeProcess(  # engine cores only, no API server
        tiny_model,
        ["--headless", *COMMON, *rpc, "--data-parallel-start-rank", "1"],
        logs / "node1.log",
        {"QAIC_VISIBLE_DEVICES": "1", "QEFF_HOME": str(dp_qeff_home), "QAIC_BACKEND": "sim"},
    )
    try:
        first = VllmServer(
            tiny_model,
            [*COMMON, *rpc],
            logs / "node0.log",
            env={"QAIC_VISIBLE_DEVICES": "0", "QEFF_HOME": str(dp_qeff_home)},
        )
    except BaseException:
        second.stop()
        raise
    yield first, second
    first.stop()
    second.stop()


def prompt_ids(i: int) -> list[int]:
    return [(5 * i + 11 * k) % 900 + 5 for k in range(4 + 6 * i)]


def test_two_nodes_serve_transformers_greedy_tokens(
    nodes: tuple[VllmServer, ServeProcess], hf_greedy: Callable[..., list[int]]
) -> None:
    first, _ = nodes
    client = openai.OpenAI(base_url=first.url + "/v1", api_key="unused", timeout=300, max_retries=0)

    def complete(i: int) -> list[int]:
        reply = client.completions.create(
            model=MODEL,
            prompt=prompt_ids(i),
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        return list(reply.choices[0].token_ids)

    with ThreadPoolExecutor(REQUESTS) as pool:
        got = list(pool.map(complete, range(REQUESTS)))
    assert got == [hf_greedy(prompt_ids(i), 8) for i in range(REQUESTS)]

    served: dict[str, float] = {}
    for line in httpx.get(first.url + "/metrics", timeout=10).text.splitlines():
        found = re.match(r'vllm:request_success_total\{.*engine="(\d+)".*\} (\S+)$', line)
        if found:
            served[found.group(1)] = served.get(found.group(1), 0.0) + float(found.group(2))
    assert sorted(served) == ["0", "1"] and all(n > 0 for n in served.values()), served


def test_each_node_ran_its_rank_on_its_own_soc(nodes: tuple[VllmServer, ServeProcess]) -> None:
    first, second = nodes
    assert "data-parallel rank 0 (local rank 0) runs on device group [0] of QAIC_VISIBLE_DEVICES=0" in (
        first.log_text()
    )
    assert "data-parallel rank 1 (local rank 0) runs on device group [0] of QAIC_VISIBLE_DEVICES=1" in (
        second.log_text()
    )
    compiles = first.log_text().count("qaic-compile (sim)") + second.log_text().count("qaic-compile (sim)")
    assert compiles == 1, "the second node should find the program in the shared cache"
