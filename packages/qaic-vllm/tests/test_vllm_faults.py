"""Device faults in a running ``vllm serve``: the faulted step's requests fail, the server goes on.

The simulator's fault plan (``QAIC_SIM_FAULTS``) makes chosen runs on QID 0 fail; concurrent
streaming clients then see only the requests that held KV fail, with the cause, and later
requests get transformers' greedy output; past the fault bound the process exits with status 1.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import served_completions
from served_completions import fault_plan, openai_client
from vllm_server import VllmServer

pytestmark = pytest.mark.serve

MODEL = "tiny-faults"
FAULTS = {"timeout": ("TIMEDOUT", 60), "dev_error": ("DEV_ERROR", 700), "reset": ("DEV_ERROR", 1400)}
"""kind -> (status the client sees, the QID 0 run it fires on)."""
ARGS = [
    "--served-model-name", MODEL,
    "--max-model-len", "256",
    "--max-num-seqs", "4",
    "--long-prefill-token-threshold", "16",
    "--dtype", "float32",
]  # fmt: skip


def prompt_ids(i: int) -> list[int]:
    return [(13 * i + 7 * k) % 800 + 11 for k in range(5 + 3 * i)]


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    log = tmp_path_factory.mktemp("serve-faults") / "vllm-serve.log"
    plan = fault_plan({kind: run for kind, (_, run) in FAULTS.items()})
    srv = VllmServer(tiny_model, ARGS, log, env={"QAIC_SIM_FAULTS": plan})
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: VllmServer) -> openai.OpenAI:
    return openai_client(server.url)


def stream(client: openai.OpenAI, i: int, max_tokens: int) -> tuple[str, str | None]:
    return served_completions.stream(client, MODEL, prompt_ids(i), max_tokens)


def greedy_ids(client: openai.OpenAI, i: int, n: int) -> list[int]:
    return served_completions.greedy_ids(client, MODEL, prompt_ids(i), n)


@pytest.mark.parametrize("kind", list(FAULTS))
def test_a_fault_fails_the_requests_it_touched_and_serving_goes_on(
    server: VllmServer, client: openai.OpenAI, hf_greedy: Callable[..., list[int]], kind: str
) -> None:
    status, _ = FAULTS[kind]
    errors: list[str] = []
    deadline = time.monotonic() + 300
    # Waves of four concurrent streams run until the fault's run number comes round.
    while not errors and time.monotonic() < deadline:
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda i: stream(client, i, 60), range(4)))
        errors = [error for _, error in results if error is not None]
    assert errors, f"the {kind} fault never fired"
    assert all("device fault" in e and status in e and "QID 0" in e for e in errors), errors
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    for i in range(3):  # after the reload, output is exact again
        assert greedy_ids(client, i, 12) == hf_greedy(prompt_ids(i), 12)
    assert f"device fault: run failed with status {status}" in server.log_text()


def test_a_fault_storm_stops_the_server_with_a_failing_status(tiny_model: Path, tmp_path: Path) -> None:
    env = {"QAIC_SIM_FAULTS": "timeout@0:run=4,timeout@0:run=8", "VLLM_QAIC_MAX_DEVICE_FAULTS": "1"}
    srv = VllmServer(tiny_model, ARGS, tmp_path / "storm.log", env=env)
    try:
        client = openai_client(srv.url, timeout=60)
        for i in range(6):
            try:
                stream(client, i, 20)
            except openai.APIConnectionError:
                break
        code = srv.proc.wait(timeout=120)
    finally:
        srv.stop()
    # Python's multiprocessing resource tracker may print its own shutdown warning after the process.
    lines = [
        line
        for line in srv.log_path.read_text(errors="replace").splitlines()
        if line.strip() and "resource_tracker" not in line and "warnings.warn" not in line
    ]
    assert code not in (0, None)
    assert lines[-1].startswith("qaic: the engine stopped while serving: 2 device faults within 600 s"), (
        lines[-3:]
    )
    assert "VLLM_QAIC_MAX_DEVICE_FAULTS" in lines[-1]


def test_recompute_policy_gives_every_request_its_exact_output(
    tiny_model: Path, hf_greedy: Callable[..., list[int]]
) -> None:
    """In-process engine: a fault mid-generation, then every request computed again from its tokens."""
    import gc

    import vllm.envs
    from vllm import LLM, SamplingParams

    from qaic_core import get_plugin_manager

    faults = get_plugin_manager().select_device_backend().faults
    assert faults is not None
    prompts = [prompt_ids(i) for i in range(4)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        mp.setenv("VLLM_QAIC_FAULT_POLICY", "recompute")
        llm = LLM(
            model=str(tiny_model),
            max_model_len=256,
            max_num_seqs=4,
            long_prefill_token_threshold=16,
            dtype="float32",
            additional_config={"override_qaic_config": {"num_cores": 4}},
        )
        try:
            faults.inject("dev_error", qid=0, at=20)  # mid-way through the decodes below
            params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            for prompt, out in zip(prompts, outs, strict=True):
                assert list(out.outputs[0].token_ids) == hf_greedy(prompt, 30)
        finally:
            faults.clear()
            del llm
            gc.collect()
    vllm.envs.disable_envs_cache()
