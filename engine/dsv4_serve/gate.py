"""The door of an engine's HTTP server: a request body size limit, admin and PD paths refused
before their body is read when the caller lacks the token, and admission while the server
drains on SIGTERM.

One ASGI middleware, ahead of routing, so that every path (OpenAI, admin, PD) gets the same
limit and its 413 is OpenAI-shaped; the generation paths are counted while they run (streams
included: an ASGI call returns only when its response is fully sent), which is what a drain
waits for, and refused with a 503 once the drain began.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

from dsv4_wire import APIError, Paths, admin_refusal
from dsv4_wire.errors import SHUTTING_DOWN
from dsv4_wire.paths import ANTHROPIC_PATHS
from dsv4_wire.auth import token_matches
from dsv4_wire.agent_apis.messages_output import error_body
from dsv4_wire.serve_options import default

DEFAULT_MAX_REQUEST_BYTES = default("max_request_bytes")  # the engine's --max-request-bytes
GENERATION_PATHS = frozenset({Paths.COMPLETIONS, Paths.CHAT_COMPLETIONS, Paths.RESPONSES, Paths.MESSAGES})


@dataclass
class Lifecycle:
    """Where the server stands: serving, draining (no new requests), closed (ending the rest)."""

    draining: bool = False
    closed: bool = False
    active: int = 0  # generation requests being answered right now


async def send_error(send, e: APIError, headers: tuple = (), path: str = "") -> None:
    # Anthropic's route answers in Anthropic's shape, at the door too
    body = json.dumps(error_body(e.status, e.message) if path in ANTHROPIC_PATHS else e.body()).encode()
    await send(
        {
            "type": "http.response.start",
            "status": e.status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers],
        }
    )
    await send({"type": "http.response.body", "body": body})


ADMIN_PREFIXES = ("/admin/", "/debug/")
PD_PREFIXES = ("/pd/", "/bootstrap/")


def unauthenticated(
    path: str, headers: dict, client_host: Optional[str], admin_token: Optional[str], pd_secret: Optional[str]
) -> Optional[APIError]:
    """Pure: why an admin or engine-to-engine request is refused before its body is read (issue
    39: a caller without the token could make the engine buffer a 16 MiB body first), else None.
    The same rules as the handlers' (dsv4_wire.auth)."""
    if path.startswith(ADMIN_PREFIXES):
        refusal = admin_refusal(headers, admin_token, client_host)
        if refusal is not None:
            status, message = refusal
            return APIError(message, status, "authentication_error" if status == 401 else "permission_error")
    if path.startswith(PD_PREFIXES) and not token_matches(headers, pd_secret):
        return APIError("PD secret required", 401, "authentication_error")
    return None


class Gate:
    def __init__(
        self,
        app,
        lifecycle: Lifecycle,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        admin_token: Optional[str] = None,
        pd_secret: Optional[str] = None,
    ):
        self.app = app
        self.lifecycle = lifecycle
        self.limit = max_request_bytes
        self.admin_token, self.pd_secret = admin_token, pd_secret

    def _too_large(self, size: int) -> APIError:
        return APIError(
            f"request body of {size} bytes exceeds the limit of {self.limit} bytes",
            413,
            param=None,
            code="request_too_large",
        )

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        generation = scope["method"] == "POST" and scope["path"] in GENERATION_PATHS
        if generation and self.lifecycle.draining:
            return await send_error(
                send,
                APIError(
                    "the server is shutting down; retry on another replica", 503, "server_error", code=SHUTTING_DOWN
                ),
                ((b"connection", b"close"),),
                scope["path"],
            )
        if scope["path"].startswith(ADMIN_PREFIXES + PD_PREFIXES):
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers") or []}
            client = scope.get("client")
            refused = unauthenticated(
                scope["path"], headers, client[0] if client else None, self.admin_token, self.pd_secret
            )
            if refused is not None:
                return await send_error(send, refused, ((b"connection", b"close"),), scope["path"])
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                return await send_error(send, APIError("invalid Content-Length header"), (), scope["path"])
            if size > self.limit:
                return await send_error(send, self._too_large(size), ((b"connection", b"close"),), scope["path"])
        # Read the body here (bounded), then hand it on: a chunked body cannot outgrow the limit.
        chunks, size, more = [], 0, True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                return await send_error(send, self._too_large(size), ((b"connection", b"close"),), scope["path"])
            chunks.append(chunk)
            more = msg.get("more_body", False)
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later reads wait for the client's disconnect, as usual

        if not generation:
            return await self.app(scope, replay, send)
        self.lifecycle.active += 1
        try:
            await self.app(scope, replay, send)
        finally:
            self.lifecycle.active -= 1
