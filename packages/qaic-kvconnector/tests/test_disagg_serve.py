"""Disaggregated serving end to end: ``qaic-disagg`` starts real ``vllm serve`` instances on the simulator.

Parity: the router's answers equal, token for token, what one instance computes alone (the decode
instance asked directly, without KV parameters) and transformers' greedy continuation, for
concurrent streaming requests, over TCP (with ngram speculation on the decode stage) and over
shared memory (two prefill instances). Failures: a prefill instance killed while its KV is on the
wire, and instances whose ctx_len differs.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from disagg_server import Disagg, VllmInstance

pytestmark = [pytest.mark.serve, pytest.mark.slow, pytest.mark.timeout(900)]

MODEL = "tiny"
COMMON = ["--served-model-name", MODEL, "--long-prefill-token-threshold", "16", "--dtype", "float32"]
GREEDY = {"ignore_eos": True, "return_token_ids": True}


def prompt_ids(i: int) -> list[int]:
    """Distinct prompts of 3 to 66 tokens (up to five 16-token chunks)."""
    return [(7 * i + 3 * k) % 900 + 5 for k in range(3 + 9 * i)]


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=300, max_retries=0)


def stream_tokens(c: openai.OpenAI, prompt: list[int], n: int) -> list[int]:
    """A streamed greedy completion's token ids, in the order they arrived."""
    stream = c.completions.create(
        model=MODEL, prompt=prompt, max_tokens=n, temperature=0, stream=True, extra_body=GREEDY
    )
    tokens: list[int] = []
    for chunk in stream:
        tokens += chunk.choices[0].token_ids or []
    return tokens


def complete_tokens(c: openai.OpenAI, prompt: list[int], n: int) -> list[int]:
    reply = c.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0, extra_body=GREEDY)
    return list(reply.choices[0].token_ids)


def arrivals(log: str) -> int:
    return sum("KV positions" in line and "arrived in" in line for line in log.splitlines())


def launch(
    model: Path,
    args: list[str],
    log_dir: Path,
    prefills: int = 1,
    decodes: int = 1,
    env: dict[str, str] | None = None,
) -> Disagg:
    d = Disagg(model, args, log_dir, prefills, decodes, env)
    try:
        return d.wait_ready()
    except BaseException:
        d.stop()
        raise


@pytest.fixture(scope="module")
def tcp_spec(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Disagg]:
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    args = [
        *COMMON, "--max-model-len", "512",
        "--prefill-device-group", "0", "--decode-device-group", "1", "--kv-transport", "tcp",
        "--prefill-max-num-seqs", "2", "--decode-max-num-seqs", "4",
        "--decode-speculative-config", json.dumps(spec),
    ]  # fmt: skip
    d = launch(tiny_model, args, tmp_path_factory.mktemp("disagg-tcp"))
    yield d
    d.stop()


def test_tcp_streaming_matches_one_instance_with_speculation_on_decode(
    tcp_spec: Disagg, hf_greedy: Callable[..., list[int]]
) -> None:
    router, single = client(tcp_spec.url), client(tcp_spec.instance_url("decode-0"))
    with ThreadPoolExecutor(8) as pool:
        routed = list(pool.map(lambda i: stream_tokens(router, prompt_ids(i), 24), range(8)))
    for i, tokens in enumerate(routed):
        assert tokens == stream_tokens(single, prompt_ids(i), 24) == hf_greedy(prompt_ids(i), 24), (
            f"request {i}"
        )
    messages = [{"role": "user", "content": "Tell me about the sea and the ships on it."}]

    def chat(c: openai.OpenAI) -> str:
        stream = c.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=16, temperature=0, stream=True
        )
        return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)

    assert chat(router) == chat(single)
    choice = {"structured_outputs": {"choice": ["alpha", "beta"]}}

    def pick(c: openai.OpenAI) -> str:
        reply = c.completions.create(
            model=MODEL, prompt="Pick one:", max_tokens=5, temperature=0, extra_body=choice
        )
        return str(reply.choices[0].text)

    assert pick(router) == pick(single) in ("alpha", "beta")
    whole = router.completions.create(model=MODEL, prompt=prompt_ids(3), max_tokens=8, temperature=0)
    alone = single.completions.create(model=MODEL, prompt=prompt_ids(3), max_tokens=8, temperature=0)
    assert set(whole.model_dump()) == set(alone.model_dump())
    assert whole.choices[0].text == alone.choices[0].text and whole.usage == alone.usage
    decode_log = tcp_spec.instance_log("decode-0")
    assert arrivals(decode_log) >= 11 and "did not arrive" not in decode_log
    assert tcp_spec.router_stats()["disaggregated"] >= 11
    metrics = httpx.get(tcp_spec.instance_url("decode-0") + "/metrics", timeout=30).text
    accepted = [
        line for line in metrics.splitlines() if line.startswith("vllm:spec_decode_num_accepted_tokens")
    ]
    assert accepted and float(accepted[0].split()[-1]) > 0


def test_shared_memory_two_prefill_instances_one_decode(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, hf_greedy: Callable[..., list[int]]
) -> None:
    args = [
        *COMMON, "--max-model-len", "512",
        "--prefill-device-group", "0", "1", "--decode-device-group", "2", "--kv-transport", "shm",
        "--prefill-max-num-seqs", "2", "--decode-max-num-seqs", "4",
    ]  # fmt: skip
    d = launch(tiny_model, args, tmp_path_factory.mktemp("disagg-shm"), prefills=2)
    try:
        router = client(d.url)
        with ThreadPoolExecutor(8) as pool:
            routed = list(pool.map(lambda i: stream_tokens(router, prompt_ids(i), 20), range(8)))
        single = client(d.instance_url("decode-0"))
        for i, tokens in enumerate(routed):
            assert tokens == stream_tokens(single, prompt_ids(i), 20) == hf_greedy(prompt_ids(i), 20), (
                f"request {i}"
            )
        stats = d.router_stats()
        assert [p["served"] > 0 for p in stats["prefill"]] == [True, True]
        decode_log = d.instance_log("decode-0")
        assert arrivals(decode_log) == 8 and "did not arrive" not in decode_log
        pids = [str(i["pid"]) for i in d.instances().values()]
        deadline = time.monotonic() + 10
        while (left := _segments()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, f"shared-memory segments left behind: {left} (instances {pids})"
    finally:
        d.stop()


def _segments() -> list[str]:
    return sorted(p.name for p in Path("/dev/shm").glob("qaic_kv_*"))


def test_transfers_overlap_decoding_and_a_prefill_killed_mid_transfer_is_recomputed(
    wide_head_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # head_dim 64 and an mxint8 KV: the KV travels compact. A 48-token prompt's 47 positions are
    # 2 layers x (K, V) x 64 values x (1 + 1/32) bytes = 12408 bytes; at 3.3e-5 Gbit/s that is 3 s on the wire.
    # Paced as a 0.5B model (about 20 ms per decode step), a 200-token stream outlives a transfer.
    args = [
        *COMMON, "--max-model-len", "256", "--kv-cache-dtype", "mxint8",
        "--prefill-device-group", "0", "--decode-device-group", "1", "--kv-transport", "tcp",
        "--kv-link-gbps", "0.000033", "--kv-link-scale", "1", "--kv-transfer-timeout", "120",
        "--prefill-max-num-seqs", "2", "--decode-max-num-seqs", "4",
    ]  # fmt: skip
    paced = {"QAIC_SIM_PACE_AS": "qwen2.5-0.5b"}
    d = launch(wide_head_model, args, tmp_path_factory.mktemp("disagg-kill"), env=paced)
    try:
        router, single = client(d.url), client(d.instance_url("decode-0"))
        prompts = [prompt_ids(5), prompt_ids(6), *(prompt_ids(i) for i in range(4))]
        refs = [complete_tokens(single, p, 12) for p in prompts]

        arrived: list[float] = []

        def background() -> None:
            stream = single.completions.create(
                model=MODEL,
                prompt=prompt_ids(0),
                max_tokens=200,
                temperature=0,
                stream=True,
                extra_body=GREEDY,
            )
            for chunk in stream:
                arrived.extend(time.monotonic() for _ in chunk.choices[0].token_ids or [])

        other = threading.Thread(target=background)
        other.start()
        while len(arrived) < 5 and other.is_alive():
            time.sleep(0.02)
        start = time.monotonic()
        assert complete_tokens(router, prompts[0], 12) == refs[0]
        end = time.monotonic()
        other.join(timeout=120)
        assert "47 KV positions (12408 bytes) arrived" in d.instance_log("decode-0")
        assert end - start > 3.0
        during = [t for t in arrived if start + 0.5 < t < end - 0.5]
        assert len(during) >= 10, f"{len(during)} tokens of the other stream while the KV was on the wire"

        result: dict[str, Any] = {}

        def victim() -> None:
            start = time.monotonic()
            result["tokens"] = stream_tokens(router, prompts[1], 12)
            result["seconds"] = time.monotonic() - start

        thread = threading.Thread(target=victim)
        thread.start()
        deadline = time.monotonic() + 60
        while d.router_stats()["disaggregated"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # the prefill instance is sending: 3 s on the wire
        d.kill("prefill-0")
        thread.join(timeout=120)
        assert result["tokens"] == refs[1]
        assert result["seconds"] < 30  # the lost connection was noticed, not the 120 s timeout
        decode_log = d.instance_log("decode-0")
        assert "did not arrive" in decode_log and "was lost" in decode_log
        with ThreadPoolExecutor(4) as pool:  # the decode instance keeps serving: every slot is free again
            after = list(pool.map(lambda p: stream_tokens(router, p, 12), prompts[2:]))
        assert after == refs[2:]
        assert d.router_stats()["prefill_failed"] >= 1
    finally:
        d.stop()


def test_instances_with_another_ctx_len_are_refused_at_start(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    args = [
        *COMMON, "--prefill-max-model-len", "256", "--decode-max-model-len", "512",
        "--prefill-device-group", "0", "--decode-device-group", "1",
        "--prefill-max-num-seqs", "2", "--decode-max-num-seqs", "4",
    ]  # fmt: skip
    d = Disagg(tiny_model, args, tmp_path_factory.mktemp("disagg-refused"))
    try:
        assert d.wait_exit(600) == 1
        text = d.tail()
        assert "refused at handshake" in text
        assert "prefill-0 and decode-0 differ: ctx_len: prefill-0 256, decode-0 512" in text
    finally:
        d.stop()


def test_decode_refuses_kv_from_another_ctx_len_and_computes_the_prompt(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    args = [
        *COMMON, "--prefill-max-model-len", "256", "--decode-max-model-len", "512", "--no-handshake-check",
        "--prefill-device-group", "0", "--decode-device-group", "1",
        "--prefill-max-num-seqs", "2", "--decode-max-num-seqs", "4",
    ]  # fmt: skip
    d = launch(tiny_model, args, tmp_path_factory.mktemp("disagg-mismatch"))
    try:
        routed = stream_tokens(client(d.url), prompt_ids(4), 10)
        assert routed == stream_tokens(client(d.instance_url("decode-0")), prompt_ids(4), 10)
        decode_log = d.instance_log("decode-0")
        assert "instances differ: ctx_len: prefill 256, decode 512" in decode_log
        assert arrivals(decode_log) == 0
    finally:
        d.stop()


def test_one_instance_in_both_roles_and_the_fail_policy(tiny_model: Path, tmp_path: Path) -> None:
    """kv_both with kv_port 0: the KV server's real port reaches the scheduler; a load that fails fails alone."""
    from qaic_kvconnector.wire import prompt_hash

    kv = {
        "kv_connector": "QaicConnector",
        "kv_role": "kv_both",
        "kv_port": 0,
        "kv_load_failure_policy": "fail",
    }
    args = [*COMMON, "--max-model-len", "256", "--max-num-seqs", "2", "--kv-transfer-config", json.dumps(kv)]
    inst = VllmInstance(tiny_model, args, tmp_path / "vllm-serve.log").wait_ready()
    try:
        prompt = prompt_ids(3)
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 10, "temperature": 0, **GREEDY}
        alone = httpx.post(inst.url + "/v1/completions", json=body, timeout=120).json()["choices"][0][
            "token_ids"
        ]
        first = httpx.post(
            inst.url + "/v1/completions",
            json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
            timeout=120,
        ).json()
        params = first["kv_transfer_params"]
        assert params["do_remote_prefill"] and params["num_tokens"] == len(prompt) - 1
        assert params["remote_port"] > 0 and f"127.0.0.1:{params['remote_port']}" in inst.log()
        handed = httpx.post(
            inst.url + "/v1/completions", json={**body, "kv_transfer_params": params}, timeout=120
        )
        assert handed.json()["choices"][0]["token_ids"] == alone
        lost = {**params, "remote_port": 1, "remote_request_id": "gone", "prompt_hash": prompt_hash(prompt)}
        failed = httpx.post(
            inst.url + "/v1/completions", json={**body, "kv_transfer_params": lost}, timeout=120
        )
        assert failed.status_code == 500
        assert "did not arrive (tcp://127.0.0.1:1 refuses connections" in inst.log()
        assert "the request fails" in inst.log()
        again = httpx.post(inst.url + "/v1/completions", json=body, timeout=120)  # the instance goes on
        assert again.json()["choices"][0]["token_ids"] == alone
    finally:
        inst.stop()
