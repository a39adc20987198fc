"""A pooling server answers generation requests with a 400 that names what it serves.

vLLM registers only the routes of the model's tasks, so ``vllm serve <embedding model> --runner
pooling`` answers ``/v1/completions`` with a bare 404. :class:`PoolingServerMiddleware` turns that 404,
on a generation endpoint of a pooling server, into an OpenAI-style 400 naming the model's task, the
endpoints it serves and the fix. Anything that answers otherwise (a route an endpoint plugin adds,
the API key check, CORS) is left as it is; a generation server is not touched.

The platform adds the middleware through vLLM's ``--middleware`` option: :func:`add_to_parser` makes
it part of that option's default (``Platform.pre_register_and_update`` gets the ``vllm serve``
parser), so ``--middleware`` given on the command line adds to it and no flag is needed.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

from qaic_core.errors import QaicConfigError
from qaic_vllm.pooling_config import pooling_task

MIDDLEWARE = "qaic_vllm.pooling_server.PoolingServerMiddleware"
GENERATION_PATHS = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/chat/completions/batch",
        "/v1/responses",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/inference/v1/generate",
        "/generative_scoring",
        "/cohere/v2/chat",
    }
)
"""vLLM 0.34's endpoints that only a generation model (the ``generate`` task) gets."""
POOLING_PATHS = ("/v1/embeddings", "/pooling", "/classify", "/score", "/rerank")
"""The endpoints a pooling server may serve, as the message lists them."""

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def add_to_parser(parser: Any) -> None:
    """Make :data:`MIDDLEWARE` part of the default of ``--middleware`` (an ``append`` option)."""
    default = list(parser.get_default("middleware") or [])
    if MIDDLEWARE not in default:
        parser.set_defaults(middleware=[MIDDLEWARE, *default])


def refusal(scope: Scope) -> str | None:
    """The message for a generation request to a pooling server; None for any other request."""
    path = str(scope.get("path", ""))
    root = str(scope.get("root_path", "") or "")
    if root and path.startswith(root):
        path = path[len(root) :]
    if path.rstrip("/") not in GENERATION_PATHS:
        return None
    app = scope.get("app")
    # Any ASGI app may sit here (a test's, another middleware's): only vLLM's carries a vllm_config.
    vllm_config = getattr(getattr(app, "state", None), "vllm_config", None)
    model_config = getattr(vllm_config, "model_config", None)
    if getattr(model_config, "runner_type", None) != "pooling":
        return None
    try:
        task = pooling_task(vllm_config)  # type: ignore[arg-type]
    except QaicConfigError:
        task = "pooling"
    routes = {getattr(route, "path", None) for route in getattr(app, "routes", [])}
    served = [p for p in POOLING_PATHS if p in routes] or list(POOLING_PATHS)
    return (
        f"this server runs a pooling model (task {task}): it serves {', '.join(served)}; "
        f"start a generation model for {path.rstrip('/')}"
    )


def error_body(message: str) -> bytes:
    """vLLM's (OpenAI's) error object for a 400."""
    return json.dumps(create_error_response(message).model_dump()).encode()


class PoolingServerMiddleware:
    """ASGI middleware: vLLM's 404 for a generation endpoint of a pooling server becomes a 400."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = refusal(scope) if scope.get("type") == "http" else None
        if message is None:
            await self.app(scope, receive, send)
            return
        replaced = False

        async def send_refusal(event: Message) -> None:
            nonlocal replaced
            if event["type"] == "http.response.start" and event.get("status") == 404:
                replaced = True
                body = error_body(message)
                headers = [
                    (k, v)
                    for k, v in event.get("headers", [])
                    if k.lower() not in (b"content-length", b"content-type")
                ]
                headers += [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ]
                await send({"type": "http.response.start", "status": 400, "headers": headers})
                await send({"type": "http.response.body", "body": body, "more_body": False})
                return
            if not replaced:  # the 404's own body is dropped
                await send(event)

        await self.app(scope, receive, send_refusal)
