"""One OpenAI endpoint in front of prefill and decode instances (``qaic-disagg``'s router).

A completion or chat request goes first to a prefill instance with ``max_tokens`` 1, no streaming
and ``kv_transfer_params: {"do_remote_decode": true}``; its answer's ``kv_transfer_params`` say
where the prompt's KV waits. The client's own request then goes, unchanged but for those
parameters, to a decode instance, whose answer (streamed or not) is passed back byte for byte:
a client sees what one instance would have sent.

When no prefill instance answers (stopped, unreachable, or an error), the request goes to a decode
instance without parameters and is computed there whole. Requests the hand-off cannot serve
(several prompts or ``n`` > 1 in one request, prompt log-probabilities) go straight to a decode
instance. Everything else (``/v1/models``, ``/tokenize``, ...) is forwarded to a decode instance.
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

log = logging.getLogger("qaic.disagg.router")

GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")
PREFILL_DROPS = (
    "stream_options",
    "min_tokens",
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
    "echo",
    "best_of",
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "kv_transfer_params",
)
"""Request fields that only shape the tokens after the first: the prefill instance does not need them."""
DOWN_S = 5.0
"""How long an instance that refused a connection is skipped."""
HOP_HEADERS = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding", "host"}
)


@dataclass
class Instance:
    """One vLLM instance behind the router."""

    url: str
    role: str
    inflight: int = 0
    down_until: float = 0.0
    served: int = 0

    @property
    def up(self) -> bool:
        return time.monotonic() >= self.down_until

    def mark_down(self) -> None:
        self.down_until = time.monotonic() + DOWN_S


@dataclass
class RouterStats:
    """Counters the router exposes at ``/qaic/router``."""

    disaggregated: int = 0
    direct: int = 0
    prefill_failed: int = 0
    prefill_seconds: list[float] = field(default_factory=list)


class Router:
    """Routes each request through one prefill and one decode instance."""

    def __init__(
        self, prefills: Sequence[str], decodes: Sequence[str], prefill_timeout_s: float = 600.0
    ) -> None:
        if not decodes:
            raise ValueError("the router needs at least one decode instance")
        self.prefills = [Instance(u.rstrip("/"), "prefill") for u in prefills]
        self.decodes = [Instance(u.rstrip("/"), "decode") for u in decodes]
        self.prefill_timeout_s = prefill_timeout_s
        self.stats = RouterStats()
        self._rr = itertools.count()
        self._session: aiohttp.ClientSession | None = None

    # -- application -------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        for path in GENERATE_PATHS:
            app.router.add_post(path, self.generate)
        app.router.add_get("/health", self.health)
        app.router.add_get("/qaic/router", self.describe)
        app.router.add_route("*", "/{tail:.*}", self.forward)
        return app

    async def _start(self, app: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        self._session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))

    async def _stop(self, app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "the router's application has not started"
        return self._session

    # -- choosing instances ------------------------------------------------------------------
    def _prefill_order(self) -> list[Instance]:
        up = [p for p in self.prefills if p.up]
        if not up:
            return []
        start = next(self._rr) % len(up)
        return up[start:] + up[:start]

    def _decode_order(self) -> list[Instance]:
        up = [d for d in self.decodes if d.up] or list(self.decodes)
        return sorted(up, key=lambda d: d.inflight)

    # -- handlers ----------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            return await self._to_decode(request, raw)
        if not isinstance(body, dict) or not _can_hand_off(body):
            self.stats.direct += 1
            return await self._to_decode(request, raw)
        params = await self._prefill(request.path, body)
        if params is None:
            self.stats.direct += 1
            return await self._to_decode(request, raw)
        self.stats.disaggregated += 1
        return await self._to_decode(request, json.dumps({**body, "kv_transfer_params": params}).encode())

    async def _prefill(self, path: str, body: dict[str, Any]) -> dict[str, Any] | None:
        """Run the prompt on a prefill instance; where its KV waits, or None to compute it on decode."""
        order = self._prefill_order()
        if not order:
            return None
        short = _prefill_body(body)
        timeout = aiohttp.ClientTimeout(total=self.prefill_timeout_s, sock_connect=10)
        for inst in order:
            start = time.perf_counter()
            inst.inflight += 1
            try:
                async with self.session.post(inst.url + path, json=short, timeout=timeout) as resp:
                    payload = await resp.read()
                    if resp.status != 200:
                        log.warning("prefill %s answered %d: %s", inst.url, resp.status, payload[:300])
                        self.stats.prefill_failed += 1
                        return None
                params = json.loads(payload).get("kv_transfer_params")
                self.stats.prefill_seconds.append(time.perf_counter() - start)
                inst.served += 1
                return params if isinstance(params, dict) and params.get("do_remote_prefill") else None
            except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
                log.warning(
                    "prefill %s failed (%s); trying the next one", inst.url, exc or type(exc).__name__
                )
                self.stats.prefill_failed += 1
                inst.mark_down()
            finally:
                inst.inflight -= 1
        return None

    async def _to_decode(self, request: web.Request, body: bytes) -> web.StreamResponse:
        """Send the request to a decode instance and pass its answer back as it comes."""
        headers = _forward_headers(request)
        for inst in self._decode_order():
            inst.inflight += 1
            try:
                try:
                    upstream = await self.session.request(
                        request.method, inst.url + request.path_qs, data=body, headers=headers
                    )
                except aiohttp.ClientConnectionError as exc:
                    log.warning("decode %s unreachable (%s); trying the next one", inst.url, exc)
                    inst.mark_down()
                    continue
                inst.served += 1
                async with upstream:
                    return await _relay(request, upstream)
            finally:
                inst.inflight -= 1
        return web.json_response(
            {
                "error": {
                    "message": "no decode instance is reachable",
                    "type": "ServiceUnavailable",
                    "code": 503,
                }
            },
            status=503,
        )

    async def forward(self, request: web.Request) -> web.StreamResponse:
        return await self._to_decode(request, await request.read())

    async def health(self, request: web.Request) -> web.Response:
        for inst in self.decodes:
            try:
                async with self.session.get(
                    inst.url + "/health", timeout=aiohttp.ClientTimeout(total=5)
                ) as r:
                    if r.status == 200:
                        return web.Response(status=200)
            except (TimeoutError, aiohttp.ClientError):
                continue
        return web.Response(status=503, text="no decode instance is healthy")

    async def describe(self, request: web.Request) -> web.Response:
        s = self.stats
        return web.json_response(
            {
                "prefill": [{"url": i.url, "up": i.up, "served": i.served} for i in self.prefills],
                "decode": [
                    {"url": i.url, "up": i.up, "served": i.served, "inflight": i.inflight}
                    for i in self.decodes
                ],
                "disaggregated": s.disaggregated,
                "direct": s.direct,
                "prefill_failed": s.prefill_failed,
                "prefill_seconds": s.prefill_seconds[-1000:],
            }
        )


def _can_hand_off(body: dict[str, Any]) -> bool:
    """Whether one prefill can serve the request: one prompt, one choice, no prompt log-probs."""
    if int(body.get("n") or 1) > 1 or int(body.get("best_of") or 1) > 1:
        return False
    if body.get("prompt_logprobs") or (body.get("echo") and body.get("logprobs") is not None):
        return False
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return len(prompt) == 1
    return True


def _prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    short = copy.deepcopy(body)
    for key in PREFILL_DROPS:
        short.pop(key, None)
    short["stream"] = False
    short["max_tokens"] = 1
    if "max_completion_tokens" in short:
        short["max_completion_tokens"] = 1
    short["kv_transfer_params"] = {"do_remote_decode": True}
    return short


def _forward_headers(request: web.Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}


async def _relay(request: web.Request, upstream: aiohttp.ClientResponse) -> web.StreamResponse:
    headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS}
    out = web.StreamResponse(status=upstream.status, reason=upstream.reason, headers=headers)
    await out.prepare(request)
    async for chunk in upstream.content.iter_any():
        await out.write(chunk)
    await out.write_eof()
    return out
