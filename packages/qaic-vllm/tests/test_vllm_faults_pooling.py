"""Device faults in a running pooling ``vllm serve``: the faulted request fails naming the fault, serving goes on.

The simulator's fault plan (``QAIC_SIM_FAULTS``) makes chosen runs on QID 0 fail (a device error,
then a reset that unloads the program); the embedding request of that run gets an error naming
the device fault, the runner reloads the program, and the next requests get embeddings equal to
transformers' (a tiny random Qwen2Model used as an embedder: the last token's hidden state,
normalized).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from served_completions import fault_plan, openai_client
from vllm_server import VllmServer

pytestmark = pytest.mark.serve

MODEL = "tiny-embedder"
CTX = 64
FAULTS = {"dev_error": 5, "reset": 12}
"""kind -> the QID 0 run it fires on (counted from the server's start)."""
PROMPTS = [[5, 17, 9], list(range(20, 50)), [101, 7, 7, 40], list(range(3, 14))]


@pytest.fixture(scope="module")
def server(
    qwen2_embedder: tuple[Path, Any], qeff_home: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServer]:
    override = {"num_cores": 4, "embed_seq_len": [8, 32, CTX]}
    args = [
        "--runner", "pooling",
        "--served-model-name", MODEL,
        "--max-model-len", str(CTX),
        "--max-num-seqs", "2",
        "--dtype", "float32",
        "--additional-config", json.dumps({"override_qaic_config": override}),
    ]  # fmt: skip
    plan = fault_plan(FAULTS)
    log = tmp_path_factory.mktemp("serve-pooling-faults") / "vllm-serve.log"
    srv = VllmServer(qwen2_embedder[0], args, log, env={"QAIC_SIM_FAULTS": plan})
    yield srv
    srv.stop()


def expected(qwen2_embedder: tuple[Path, Any], prompt: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        last = qwen2_embedder[1](torch.tensor([prompt])).last_hidden_state[0, -1].numpy()
    return np.asarray(last / np.linalg.norm(last))


def embed(client: openai.OpenAI, prompt: list[int]) -> tuple[list[float] | None, str | None]:
    """(the embedding, None) or (None, the error message)."""
    try:
        reply = client.embeddings.create(model=MODEL, input=[prompt])
    except openai.APIError as exc:
        return None, str(exc)
    return reply.data[0].embedding, None


@pytest.mark.parametrize("kind", list(FAULTS))
def test_a_fault_fails_the_request_it_touched_and_embeddings_stay_exact(
    server: VllmServer, qwen2_embedder: tuple[Path, Any], kind: str
) -> None:
    client = openai_client(server.url)
    error = None
    for i in range(40):  # one run per request: the fault's run comes round within a few
        prompt = PROMPTS[i % len(PROMPTS)]
        got, error = embed(client, prompt)
        if error is not None:
            break
        np.testing.assert_allclose(np.asarray(got), expected(qwen2_embedder, prompt), atol=1e-5)
    assert error is not None, f"the {kind} fault never fired"
    assert "device fault" in error and "DEV_ERROR" in error and "QID 0" in error, error
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    for prompt in PROMPTS:  # the program was reloaded: every embedding is exact again
        got, again = embed(client, prompt)
        assert again is None, again
        np.testing.assert_allclose(np.asarray(got), expected(qwen2_embedder, prompt), atol=1e-5)
    assert "device fault" in server.log_text()
