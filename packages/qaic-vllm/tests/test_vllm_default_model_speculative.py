"""N-gram speculative decoding on the trained default model behind a real ``vllm serve``."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import openai
import pytest
from vllm_server import VllmServer

from qaic_vllm.cli import DEFAULTS
from qaic_vllm.default_model import DEFAULT_MODEL_NAME, ensure_default_model

pytestmark = pytest.mark.serve

ANSWER = "Return the square root of x."
CONVERSATION = [
    message
    for name in ("sqrt", "isqrt", "cbrt")
    for message in (
        {"role": "user", "content": f"What does math.{name} do?"},
        {"role": "assistant", "content": ANSWER},
    )
] + [{"role": "user", "content": "What does math.sqrt do?"}]
"""A repetitive chat: the same kind of question, the same answer, three times, then the question again."""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    log = tmp_path_factory.mktemp("serve-default-ngram") / "vllm-serve.log"
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    args = ["--served-model-name", DEFAULT_MODEL_NAME, "--speculative-config", json.dumps(spec)]
    for flag, value in DEFAULTS.items():
        args += [flag, value]
    srv = VllmServer(ensure_default_model(), args, log)
    yield srv
    srv.stop()


def test_ngram_drafts_are_accepted_on_a_repetitive_prompt(server: VllmServer) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=300, max_retries=0)
    reply = client.chat.completions.create(
        model=DEFAULT_MODEL_NAME,
        messages=CONVERSATION,  # type: ignore[arg-type]
        max_tokens=32,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    text = reply.choices[0].message.content
    assert text
    drafts = counter(server, "vllm:spec_decode_num_draft_tokens")
    accepted = counter(server, "vllm:spec_decode_num_accepted_tokens")
    print(f"n-gram drafts accepted: {accepted:.0f} of {drafts:.0f}; answer {text!r}")
    assert drafts > 0 and 0 < accepted <= drafts, (drafts, accepted, text)


def counter(server: VllmServer, name: str) -> float:
    """A counter of vLLM's /metrics (Prometheus writes it as ``<name>_total``), summed over its labels."""
    text = httpx.get(server.url + "/metrics", timeout=30).text
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if re.match(rf"{name}(_total)?[{{ ]", line)
    ]
    assert values, f"/metrics has no {name}: " + str(
        [line for line in text.splitlines() if "spec_decode" in line]
    )
    return sum(values)
