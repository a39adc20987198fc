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
from vllm_server import VllmServer

pytestmark = pytest.mark.serve

MODEL = "tiny-embedder"
CTX = 64
FAULTS = {"dev_error": 5, "reset": 12}
"""kind -> the QID 0 run it fires on (counted from the server's start)."""
PROMPTS = [[5, 17, 9], list(range(20, 50)), [101, 7, 7, 40], list(range(3, 14))]


@pytest.fixture(scope="module")
def embedder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A tiny random Qwen2Model with the package's tokenizer (vLLM serves it with last-token pooling)."""
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


@pytest.fixture(scope="module")
def server(
    embedder: tuple[Path, Any], qeff_home: Path, tmp_path_factory: pytest.TempPathFactory
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
    plan = ",".join(f"{kind}@0:run={run}" for kind, run in FAULTS.items())
    log = tmp_path_factory.mktemp("serve-pooling-faults") / "vllm-serve.log"
    srv = VllmServer(embedder[0], args, log, env={"QAIC_SIM_FAULTS": plan})
    yield srv
    srv.stop()


def expected(embedder: tuple[Path, Any], prompt: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        last = embedder[1](torch.tensor([prompt])).last_hidden_state[0, -1].numpy()
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
    server: VllmServer, embedder: tuple[Path, Any], kind: str
) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120, max_retries=0)
    error = None
    for i in range(40):  # one run per request: the fault's run comes round within a few
        prompt = PROMPTS[i % len(PROMPTS)]
        got, error = embed(client, prompt)
        if error is not None:
            break
        np.testing.assert_allclose(np.asarray(got), expected(embedder, prompt), atol=1e-5)
    assert error is not None, f"the {kind} fault never fired"
    assert "device fault" in error and "DEV_ERROR" in error and "QID 0" in error, error
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    for prompt in PROMPTS:  # the program was reloaded: every embedding is exact again
        got, again = embed(client, prompt)
        assert again is None, again
        np.testing.assert_allclose(np.asarray(got), expected(embedder, prompt), atol=1e-5)
    assert "device fault" in server.log_text()
