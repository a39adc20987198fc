"""KV server and client on 127.0.0.1: both transports, the handshake refusal and each failure."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

from qaic_core.execution import SlotKV
from qaic_kvconnector import wire
from qaic_kvconnector.transport import KVClient, KVServer, TransferError, endpoint, hello

FP = wire.fingerprint("tiny", 256, SlotKV(1, {"past_key.0": np.zeros((1, 2, 1, 16), np.float32)}, "float32"))


def _kv(tokens: int = 5) -> SlotKV:
    rng = np.random.default_rng(tokens)
    return SlotKV(
        tokens,
        {n: rng.normal(size=(1, 2, tokens, 16)).astype(np.float32) for n in ("past_key.0", "past_value.0")},
        "float32",
    )


@pytest.fixture(params=["tcp", "shm"])
def server(request: pytest.FixtureRequest) -> Iterator[KVServer]:
    srv = KVServer("127.0.0.1", 0, FP, request.param, keep_s=30)
    yield srv
    srv.close()


def _hold(server: KVServer, req_id: str, kv: SlotKV) -> None:
    server.hold(req_id, *wire.encode_kv(kv))


def test_fetch_delivers_the_kv_once(server: KVServer) -> None:
    kv = _kv()
    _hold(server, "r1", kv)
    client = KVClient(FP, timeout_s=5)
    got = client.fetch("127.0.0.1", server.port, "r1").result()
    assert got.nbytes == sum(a.nbytes for a in kv.tensors.values())
    for name, arr in kv.tensors.items():
        assert np.array_equal(got.kv.tensors[name], arr)
    deadline = time.monotonic() + 5
    while server.held() and time.monotonic() < deadline:  # shm: freed when the RELEASE lands
        time.sleep(0.05)
    assert server.held() == 0
    with pytest.raises(TransferError, match="holds no KV for request r1"):
        client.fetch("127.0.0.1", server.port, "r1").result()
    client.close()


def test_handshake_refuses_other_instances_naming_the_difference(server: KVServer) -> None:
    _hold(server, "r1", _kv())
    other = dict(FP, ctx_len=512)
    with pytest.raises(TransferError, match="instances differ: ctx_len: prefill 256, decode 512"):
        KVClient(other, timeout_s=5).fetch("127.0.0.1", server.port, "r1").result()
    assert server.held() == 1
    assert hello(endpoint("127.0.0.1", server.port)) == FP


def test_a_stopped_or_silent_instance_fails_the_fetch_quickly() -> None:
    srv = KVServer("127.0.0.1", 0, FP)
    port = srv.port
    srv.close()
    client = KVClient(FP, timeout_s=20)
    start = time.monotonic()
    with pytest.raises(TransferError, match="refuses connections"):
        client.fetch("127.0.0.1", port, "r1").result()
    assert time.monotonic() - start < 5
    slow = KVServer("127.0.0.1", 0, FP, link_gbps=1e-6)  # 80 s for this KV: the fetch times out first
    _hold(slow, "r1", _kv())
    start = time.monotonic()
    with pytest.raises(TransferError, match=r"no answer .* within 1s"):
        KVClient(FP, timeout_s=1).fetch("127.0.0.1", slow.port, "r1").result()
    assert time.monotonic() - start < 5
    slow.close()


def test_link_pacing_and_expiry() -> None:
    kv = _kv(40)
    nbytes = sum(a.nbytes for a in kv.tensors.values())
    srv = KVServer("127.0.0.1", 0, FP, link_gbps=nbytes * 8 / 0.5e9, keep_s=0.3)  # 0.5 s per transfer
    _hold(srv, "r1", kv)
    got = KVClient(FP, timeout_s=5).fetch("127.0.0.1", srv.port, "r1").result()
    assert 0.45 < got.seconds < 3
    _hold(srv, "r2", kv)
    time.sleep(0.8)
    assert srv.held() == 0
    srv.close()
