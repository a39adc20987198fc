"""One real ``vllm serve`` on the simulator, driven by the official openai client."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
from vllm_server import VllmServer

pytestmark = pytest.mark.serve

FULL_BATCH = 4
CTX = 512
MODEL = "tiny"
IGNORE_EOS = {"ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    log = tmp_path_factory.mktemp("serve") / "vllm-serve.log"
    args = [
        "--served-model-name", MODEL,
        "--max-model-len", str(CTX),
        "--max-num-seqs", str(FULL_BATCH),
        "--long-prefill-token-threshold", "16",
        "--dtype", "float32",
    ]  # fmt: skip
    # Paced as a 0.5B model (about 20 ms per decode step), so a 400-token stream outlives the
    # checks that watch it run: the tiny model alone could finish it before the first check.
    srv = VllmServer(tiny_model, args, log, env={"QAIC_SIM_PACE_AS": "qwen2.5-0.5b"})
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: VllmServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=300, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def prompt_ids(i: int) -> list[int]:
    """Distinct token prompts of different lengths (some span several 16-token chunks)."""
    return [(7 * i + 3 * k) % 900 + 5 for k in range(3 + 9 * i)]


def complete(client: openai.OpenAI, prompt: Any, max_tokens: int, **kwargs: Any) -> Any:
    extra = {**IGNORE_EOS, **kwargs.pop("extra_body", {})}
    kwargs.setdefault("temperature", 0)
    return client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, extra_body=extra, **kwargs
    )


def test_completions_match_transformers(
    client: openai.OpenAI, tokenizer: Any, hf_greedy: Callable[..., list[int]]
) -> None:
    for i in range(3):
        choice = complete(client, prompt_ids(i), 12).choices[0]
        assert choice.token_ids == hf_greedy(prompt_ids(i), 12)
    text = "Once upon a time there was a small language model."
    reply = complete(client, text, 10)
    choice = reply.choices[0]
    assert choice.prompt_token_ids == tokenizer(text)["input_ids"]
    assert choice.token_ids == hf_greedy(choice.prompt_token_ids, 10)
    assert reply.usage.completion_tokens == 10 and choice.finish_reason == "length"


def test_chat_uses_the_chat_template(
    client: openai.OpenAI, tokenizer: Any, hf_greedy: Callable[..., list[int]]
) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, extra_body=IGNORE_EOS
    )
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<s>assistant\n") and "Be brief." in text
    expected_prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert reply.model_dump()["prompt_token_ids"] == list(expected_prompt)
    choice = reply.choices[0]
    assert choice.model_dump()["token_ids"] == hf_greedy(list(expected_prompt), 8)
    assert choice.message.role == "assistant"


def test_streaming_equals_the_whole_reply(client: openai.OpenAI) -> None:
    whole = complete(client, prompt_ids(1), 16).choices[0].text
    stream = client.completions.create(
        model=MODEL, prompt=prompt_ids(1), max_tokens=16, temperature=0, stream=True, extra_body=IGNORE_EOS
    )
    pieces = [chunk.choices[0].text for chunk in stream if chunk.choices]
    assert len(pieces) > 4
    assert "".join(pieces) == whole


def test_n_choices(client: openai.OpenAI, hf_greedy: Callable[..., list[int]]) -> None:
    # top_k=1 makes every sampled choice the greedy one (vLLM refuses n > 1 with temperature 0).
    narrow = complete(client, prompt_ids(2), 6, n=3, temperature=1.0, extra_body={"top_k": 1})
    assert len(narrow.choices) == 3
    assert all(c.token_ids == hf_greedy(prompt_ids(2), 6) for c in narrow.choices)
    sampled = client.completions.create(
        model=MODEL, prompt=prompt_ids(2), max_tokens=6, n=2, temperature=1.0, seed=4, extra_body=IGNORE_EOS
    )
    assert sorted(c.index for c in sampled.choices) == [0, 1]
    assert all(len(c.token_ids) == 6 for c in sampled.choices)


def test_stop_strings_and_max_tokens(client: openai.OpenAI) -> None:
    full = complete(client, prompt_ids(3), 16).choices[0]
    text = full.text
    stop = next(text[i : i + 2] for i in range(len(text) // 3, len(text)) if text[i : i + 2].strip())
    stopped = complete(client, prompt_ids(3), 16, stop=[stop]).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == text[: text.index(stop)]
    short = complete(client, prompt_ids(3), 5)
    assert short.usage.completion_tokens == 5 and short.choices[0].finish_reason == "length"


def test_logprobs(client: openai.OpenAI, hf_logprobs: Callable[..., Any]) -> None:
    choice = complete(client, prompt_ids(1), 6, logprobs=2).choices[0]
    ids = choice.token_ids
    ref = hf_logprobs(prompt_ids(1) + ids)
    start = len(prompt_ids(1)) - 1
    for i, value in enumerate(choice.logprobs.token_logprobs):
        assert abs(value - float(ref[start + i][ids[i]])) < 1e-3
    assert all(len(top) >= 2 for top in choice.logprobs.top_logprobs)


def test_twice_the_batch_concurrently(client: openai.OpenAI, hf_greedy: Callable[..., list[int]]) -> None:
    n = 2 * FULL_BATCH  # half of them queue until a slot frees
    with ThreadPoolExecutor(n) as pool:
        replies = list(pool.map(lambda i: complete(client, prompt_ids(i), 48), range(n)))
    for i, reply in enumerate(replies):
        assert reply.choices[0].token_ids == hf_greedy(prompt_ids(i), 48), f"request {i}"


def _open_streams(client: openai.OpenAI, first: int, count: int, max_tokens: int) -> list[Any]:
    """Start ``count`` streams and read two chunks of each, so all of them are running."""
    streams = []
    for i in range(first, first + count):
        stream = client.completions.create(
            model=MODEL, prompt=prompt_ids(i), max_tokens=max_tokens, stream=True, extra_body=IGNORE_EOS
        )
        chunks = iter(stream)
        next(chunks)
        next(chunks)
        streams.append((stream, chunks))
    return streams


def test_disconnect_frees_the_slot(server: VllmServer, client: openai.OpenAI) -> None:
    streams = _open_streams(client, 0, FULL_BATCH, 400)
    assert server.settled_metric("vllm:num_requests_running", FULL_BATCH) == FULL_BATCH
    for stream, _ in streams:
        stream.response.close()  # the client goes away mid-stream
    assert server.settled_metric("vllm:num_requests_running", 0) == 0

    # A following full batch gets every slot back and completes.
    streams = _open_streams(client, 4, FULL_BATCH, 400)
    assert server.settled_metric("vllm:num_requests_running", FULL_BATCH) == FULL_BATCH
    for _, chunks in streams:
        rest = list(chunks)
        assert rest[-1].choices[0].finish_reason == "length"
    assert server.settled_metric("vllm:num_requests_running", 0) == 0


def test_structured_output_choice(client: openai.OpenAI) -> None:
    reply = client.completions.create(
        model=MODEL,
        prompt=prompt_ids(2),
        max_tokens=8,
        temperature=0,
        extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}},
    )
    assert reply.choices[0].text in {"alpha", "beta"}
    assert reply.choices[0].finish_reason == "stop"


def test_too_long_prompt_is_rejected_and_serving_goes_on(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        complete(client, [11] * (CTX + 10), 4)
    assert info.value.status_code == 400
    assert "maximum context length" in str(info.value)
    assert complete(client, prompt_ids(0), 4).usage.completion_tokens == 4


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"extra_body": {"prompt_logprobs": 1}}, "prompt_logprobs"),
    ],
)
def test_unsupported_options_get_a_clear_400(
    client: openai.OpenAI, kwargs: dict[str, Any], needle: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        complete(client, prompt_ids(0), 4, **kwargs)
    assert needle in str(info.value) and "qaic" in str(info.value)
