"""Device faults in the eager (pyt) mode: the requests that held KV pay, the server goes on, output stays exact.

The simulator's fault plan (``QAIC_SIM_FAULTS``) makes chosen eager steps on QID 0 fail (a timeout,
a device error, a reset that takes the model's memory). A fault empties every KV block, so every
request holding blocks fails with the cause (``fail``) or is computed again from its tokens
(``recompute``), the prefix cache is forgotten, and later requests get transformers' greedy
output, prompts whose prefix was cached before the fault included.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import openai
import pytest
import served_completions
from served_completions import fault_plan, openai_client
from vllm_server import VllmServer

if TYPE_CHECKING:
    import torch

pytestmark = pytest.mark.serve

MODEL = "tiny-faults-pyt"
FAULTS = {"timeout": ("TIMEDOUT", 40), "dev_error": ("DEV_ERROR", 260), "reset": ("DEV_ERROR", 480)}
"""kind -> (status the client sees, the QID 0 eager step it fires on)."""
ARGS = [
    "--served-model-name", MODEL,
    "--max-model-len", "256",
    "--max-num-seqs", "4",
    "--max-num-batched-tokens", "32",
    "--dtype", "float32",
]  # fmt: skip
SHARED = [(11 * k) % 700 + 20 for k in range(40)]
"""A prefix of two and a half 16-token blocks shared by every prompt: cached before a fault."""


def prompt_ids(i: int) -> list[int]:
    return [*SHARED, *((13 * i + 7 * k) % 800 + 11 for k in range(3 + 2 * i))]


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    log = tmp_path_factory.mktemp("serve-faults-pyt") / "vllm-serve.log"
    plan = fault_plan({kind: run for kind, (_, run) in FAULTS.items()})
    env = {"QAIC_SIM_FAULTS": plan, "VLLM_QAIC_EXECUTION_MODE": "pyt"}
    srv = VllmServer(tiny_model, ARGS, log, env=env)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: VllmServer) -> openai.OpenAI:
    return openai_client(server.url)


def stream(client: openai.OpenAI, i: int, max_tokens: int) -> tuple[str, str | None]:
    return served_completions.stream(client, MODEL, prompt_ids(i), max_tokens)


def greedy_ids(client: openai.OpenAI, i: int, n: int) -> list[int]:
    return served_completions.greedy_ids(client, MODEL, prompt_ids(i), n)


def eager_model(llm: Any) -> torch.nn.Module:
    """The vLLM model class the in-process engine's eager step model runs."""
    worker = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
    return worker.paged_model.model  # type: ignore[no-any-return]


def test_the_server_runs_the_eager_mode(server: VllmServer) -> None:
    assert "pyt execution mode" in server.log_text()


@pytest.mark.parametrize("kind", list(FAULTS))
def test_a_fault_fails_the_requests_that_held_kv_and_serving_goes_on(
    server: VllmServer, client: openai.OpenAI, hf_greedy: Callable[..., list[int]], kind: str
) -> None:
    status, _ = FAULTS[kind]
    errors: list[str] = []
    deadline = time.monotonic() + 300
    # Waves of four concurrent streams (their shared prefix cached) run until the fault's step comes round.
    while not errors and time.monotonic() < deadline:
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda i: stream(client, i, 60), range(4)))
        errors = [error for _, error in results if error is not None]
    assert errors, f"the {kind} fault never fired"
    assert all("device fault" in e and status in e and "QID 0" in e for e in errors), errors
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    for i in range(3):  # KV and the prefix cache were emptied: output is exact again
        assert greedy_ids(client, i, 12) == hf_greedy(prompt_ids(i), 12)
    assert "device fault" in server.log_text()


def test_recompute_policy_gives_every_request_its_exact_output(
    tiny_model: Path, hf_greedy: Callable[..., list[int]]
) -> None:
    """In-process engine: a fault mid-generation, then a reset that takes the weights; every request
    is computed again from its tokens, with prefix caching on."""
    import gc

    import torch
    import vllm.envs
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from qaic_core import get_plugin_manager
    from qaic_sim.machine import get_machine

    faults = get_plugin_manager().select_device_backend().faults
    assert faults is not None
    qid0 = get_machine().topology.device(0)
    assert qid0 is not None
    prompts = [TokensPrompt(prompt_token_ids=prompt_ids(i)) for i in range(4)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        mp.setenv("VLLM_QAIC_FAULT_POLICY", "recompute")
        llm = LLM(
            model=str(tiny_model),
            max_model_len=256,
            max_num_seqs=4,
            max_num_batched_tokens=32,
            dtype="float32",
            additional_config={"execution_mode": "pyt"},
        )
        try:
            assert llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
            params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
            first = llm.generate(prompts[:1], params)  # the shared prefix is cached
            assert list(first[0].outputs[0].token_ids) == hf_greedy(prompt_ids(0), 30)
            held = qid0.dram_used
            faults.inject("dev_error", qid=0, at=20)  # mid-way through the decodes below
            outs = llm.generate(prompts, params)
            for i, out in enumerate(outs):
                assert list(out.outputs[0].token_ids) == hf_greedy(prompt_ids(i), 30), i
            # A reset on the next step: the QID forgets the model's memory; steps fail until the
            # model holds its weights and KV cache again. On a card the reset also takes the weights'
            # contents: zeroed here, so only weights loaded again give the right tokens.
            with torch.no_grad():
                for weight in eager_model(llm).parameters():
                    weight.zero_()
            faults.inject("reset", qid=0, at=1)
            outs = llm.generate(prompts[1:], params)
            for i, out in enumerate(outs, start=1):
                assert list(out.outputs[0].token_ids) == hf_greedy(prompt_ids(i), 30), i
            assert not get_machine().faults.armed()  # both faults fired
            assert qid0.dram_used == held  # weights and KV cache reserved again on the QID
        finally:
            faults.clear()
            del llm
            gc.collect()
    vllm.envs.disable_envs_cache()
