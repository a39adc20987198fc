"""The router against stand-in instances: what each stage receives, streaming relay and fall-backs."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from qaic_kvconnector.router import Router

PARAMS = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1, "remote_request_id": "p-1"}


class Stub:
    """A stand-in vLLM instance recording the bodies it got."""

    def __init__(self, role: str, status: int = 200) -> None:
        self.role = role
        self.status = status
        self.bodies: list[dict[str, Any]] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if self.status != 200:
            return web.json_response({"error": "boom"}, status=self.status)
        if self.role == "prefill":
            return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": PARAMS})
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(3):
                await resp.write(f"data: {json.dumps({'i': i})}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        return web.json_response({"echo": body})

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_post("/v1/chat/completions", self.handle)
        app.router.add_get("/v1/models", lambda r: web.json_response({"data": [{"id": "tiny"}]}))
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


Scenario = Callable[[str, list[Stub], list[Stub]], Awaitable[None]]


async def _with_router(prefill: list[Stub], decode: list[Stub], scenario: Scenario, dead: int = 0) -> None:
    for stub in prefill + decode:
        await stub.start()
    urls = [f"http://127.0.0.1:{_dead_port()}" for _ in range(dead)] + [s.url for s in prefill]
    router = Router(urls, [s.url for s in decode])
    runner = web.AppRunner(router.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        await scenario(f"http://127.0.0.1:{port}", prefill, decode)
    finally:
        await runner.cleanup()
        for stub in prefill + decode:
            await stub.stop()


def _dead_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _post(url: str, body: dict[str, Any]) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as resp:
        return resp.status, await resp.read()


def run(coro: Awaitable[None]) -> None:
    asyncio.run(coro)  # type: ignore[arg-type]


def test_prefill_then_decode_with_the_kv_parameters() -> None:
    async def scenario(url: str, prefill: list[Stub], decode: list[Stub]) -> None:
        body = {
            "model": "tiny",
            "prompt": "hi",
            "max_tokens": 7,
            "stream": False,
            "min_tokens": 3,
            "logprobs": 2,
        }
        status, payload = await _post(url + "/v1/completions", body)
        assert status == 200
        sent = prefill[0].bodies[0]
        assert sent["max_tokens"] == 1 and sent["stream"] is False
        assert sent["kv_transfer_params"] == {"do_remote_decode": True}
        assert "min_tokens" not in sent and "logprobs" not in sent
        assert json.loads(payload)["echo"] == {**body, "kv_transfer_params": PARAMS}
        chat = {"model": "tiny", "messages": [], "max_completion_tokens": 5, "stream": True}
        status, payload = await _post(url + "/v1/chat/completions", chat)
        assert prefill[0].bodies[1]["max_completion_tokens"] == 1
        assert decode[0].bodies[1]["kv_transfer_params"] == PARAMS
        assert payload.decode().count("data:") == 4 and payload.endswith(b"data: [DONE]\n\n")
        async with aiohttp.ClientSession() as session, session.get(url + "/v1/models") as resp:
            assert (await resp.json())["data"][0]["id"] == "tiny"
        async with aiohttp.ClientSession() as session, session.get(url + "/qaic/router") as resp:
            assert (await resp.json())["disaggregated"] == 2

    run(_with_router([Stub("prefill")], [Stub("decode")], scenario))


def test_requests_one_prefill_cannot_serve_go_to_decode() -> None:
    async def scenario(url: str, prefill: list[Stub], decode: list[Stub]) -> None:
        for body in (
            {"prompt": ["a", "b"], "max_tokens": 2},
            {"prompt": "a", "n": 2, "max_tokens": 2},
            {"prompt": "a", "echo": True, "logprobs": 1, "max_tokens": 2},
        ):
            assert (await _post(url + "/v1/completions", body))[0] == 200
        assert prefill[0].bodies == []
        assert all("kv_transfer_params" not in b for b in decode[0].bodies)

    run(_with_router([Stub("prefill")], [Stub("decode")], scenario))


@pytest.mark.parametrize("failure", ["unreachable", "error"])
def test_without_a_prefill_answer_decode_computes_the_prompt(failure: str) -> None:
    async def scenario(url: str, prefill: list[Stub], decode: list[Stub]) -> None:
        status, payload = await _post(url + "/v1/completions", {"prompt": "a", "max_tokens": 2})
        assert status == 200
        assert "kv_transfer_params" not in json.loads(payload)["echo"]

    stubs = [] if failure == "unreachable" else [Stub("prefill", status=500)]
    run(_with_router(stubs, [Stub("decode")], scenario, dead=1 if failure == "unreachable" else 0))


def test_a_dead_prefill_is_skipped_for_a_live_one() -> None:
    async def scenario(url: str, prefill: list[Stub], decode: list[Stub]) -> None:
        for _ in range(3):
            await _post(url + "/v1/completions", {"prompt": "a", "max_tokens": 2})
        assert len(prefill[0].bodies) == 3
        assert all(b["kv_transfer_params"] == PARAMS for b in decode[0].bodies)

    run(_with_router([Stub("prefill")], [Stub("decode")], scenario, dead=1))
