"""What the fault and metrics tests ask of a real server: a fault plan, a client, streamed and greedy completions."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import openai


def fault_plan(runs: Mapping[str, int]) -> str:
    """``QAIC_SIM_FAULTS`` for faults on QID 0: kind -> the run it fires on."""
    return ",".join(f"{kind}@0:run={run}" for kind, run in runs.items())


def openai_client(url: str, timeout: float = 120) -> openai.OpenAI:
    """A real OpenAI client of the server at ``url``, without retries (a failed request stays failed)."""
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=timeout, max_retries=0)


def stream(
    client: openai.OpenAI, model: str, prompt: Sequence[int], max_tokens: int
) -> tuple[str, str | None]:
    """(text received, error message or None) of one greedy streaming completion of ``max_tokens``."""
    text = ""
    try:
        chunks = client.completions.create(
            model=model,
            prompt=list(prompt),
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for chunk in chunks:
            text += chunk.choices[0].text if chunk.choices else ""
    except openai.APIError as exc:
        return text, str(exc)
    return text, None


def greedy_ids(client: openai.OpenAI, model: str, prompt: Sequence[int], n: int) -> list[int]:
    """The token ids of ``n`` greedy tokens (vLLM's ``return_token_ids``)."""
    reply = client.completions.create(
        model=model,
        prompt=list(prompt),
        max_tokens=n,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    return list(reply.choices[0].token_ids)  # type: ignore[attr-defined]  # vLLM's return_token_ids
