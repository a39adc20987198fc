"""The trained default model behind a real ``vllm serve``: the README's request and chat answer in words."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from vllm_server import VllmServer

from qaic_vllm.cli import DEFAULTS
from qaic_vllm.default_model import DEFAULT_MODEL_NAME, ensure_default_model

pytestmark = pytest.mark.serve

README = Path(__file__).resolve().parents[3] / "README.md"
CHAT_PROMPTS = [
    "What does json.dumps do?",
    "Tell me about the for statement.",
    "What is the pathlib module?",
    "What does a while loop do?",
    "Hello!",
]


def readme_request() -> dict[str, Any]:
    """The JSON body of the quick start's ``curl .../v1/completions`` request, as the README prints it."""
    match = re.search(r"curl -s \S+/v1/completions .*?-d '(\{.*?\})'", README.read_text(), re.DOTALL)
    assert match, f"{README} has no quick-start curl request to /v1/completions"
    body: dict[str, Any] = json.loads(match.group(1))
    return body


def words(text: str) -> list[str]:
    return [w.lower() for w in re.findall(r"[A-Za-z]+", text)]


def topics_vocabulary() -> set[str]:
    """Every word of ``pydoc_data.topics``: the text the model was trained on, read here on its own."""
    from pydoc_data.topics import topics

    return set(words(" ".join(topics.values())))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    log = tmp_path_factory.mktemp("serve-default") / "vllm-serve.log"
    args = ["--served-model-name", DEFAULT_MODEL_NAME]
    for flag, value in DEFAULTS.items():
        args += [flag, value]
    srv = VllmServer(ensure_default_model(), args, log)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: VllmServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=300, max_retries=0)


def test_the_readme_request_answers_in_words_from_the_python_docs(client: openai.OpenAI) -> None:
    body = readme_request()
    assert body["model"] == DEFAULT_MODEL_NAME
    reply = client.completions.create(**body)
    text = reply.choices[0].text
    assert "\ufffd" not in text, text
    said = words(text)
    assert len(said) >= 3, text
    known = topics_vocabulary()
    share = sum(w in known for w in said) / len(said)
    assert share >= 0.7, f"{share:.0%} of the words of {text!r} are in pydoc_data.topics"


def test_chat_answers_end_at_the_end_of_text_token(client: openai.OpenAI) -> None:
    max_tokens = 64
    finished = []
    for prompt in CHAT_PROMPTS:
        reply = client.chat.completions.create(
            model=DEFAULT_MODEL_NAME,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=max_tokens,
            temperature=0,
        )
        choice = reply.choices[0]
        assert choice.message.content and choice.message.content.strip(), prompt
        assert "\ufffd" not in choice.message.content and "</s>" not in choice.message.content
        if choice.finish_reason == "stop":
            assert reply.usage is not None and reply.usage.completion_tokens < max_tokens
        finished.append(choice.finish_reason)
    assert finished.count("stop") > len(CHAT_PROMPTS) / 2, finished
