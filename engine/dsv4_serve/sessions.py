"""Which conversation a request belongs to, from its HTTP request: OpenAI's `prompt_cache_key`
field or the `x-session-id` header (the field wins), and `session_ttl` or `x-session-ttl`
(seconds its prefix stays pinned after this round; default the engine's --session-ttl). The engine keys the session
by (cache salt, name): dsv4_engine.session_pins. Bad values are a 400 naming the field."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Mapping, Optional

from fastapi import Request

from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.session_pins import MAX_SESSION_ID_CHARS, MAX_TTL_S
from dsv4_serve.engine_client import CORE_ANSWER_TIMEOUT, EngineGone
from dsv4_wire import APIError, Paths

SESSION_HEADER = "x-session-id"
SESSION_TTL_HEADER = "x-session-ttl"


def session_of(
    field: Optional[str], ttl_field: Optional[float], headers: Mapping[str, str]
) -> tuple[Optional[str], Optional[float]]:
    """(session name or None, TTL in seconds or None) of a request: the body's fields
    (`prompt_cache_key`, `session_ttl`: the router moves the headers there), else the headers."""
    name = field if field is not None else headers.get(SESSION_HEADER)
    if name is not None and not (1 <= len(name) <= MAX_SESSION_ID_CHARS):
        param = "prompt_cache_key" if field is not None else SESSION_HEADER
        raise APIError(f"{param} must be 1 to {MAX_SESSION_ID_CHARS} characters", param=param)
    raw = ttl_field if ttl_field is not None else headers.get(SESSION_TTL_HEADER)
    param = "session_ttl" if ttl_field is not None else SESSION_TTL_HEADER
    if raw is None:
        return name, None
    try:
        ttl = float(raw)
    except ValueError:
        ttl = float("nan")
    if not (0 < ttl <= MAX_TTL_S):
        raise APIError(f"{param} is seconds, more than 0 and at most {MAX_TTL_S:g}; got {raw!r:.40}", param=param)
    if name is None:
        raise APIError(f"{param} needs a session: give prompt_cache_key or {SESSION_HEADER}", param=param)
    return name, ttl


def with_session(p: SamplingParams, name: Optional[str], ttl: Optional[float]) -> SamplingParams:
    return p if name is None else replace(p, session=name, session_ttl=ttl)


def add_session_routes(app, client, args) -> None:
    """DELETE /v1/sessions/{id}: end a session now (its pins go; its pages stay cached, plain
    LRU). The tenant is the request's cache salt (`?cache_salt=`, as its generation requests
    carried it; the router fills it from the API key): another tenant's session of the same name
    is another session, so it answers 404 as for a name never seen."""

    @app.delete(Paths.SESSIONS + "/{session_id}")
    async def delete_session(session_id: str, http: Request):
        salt = http.query_params.get("cache_salt")
        if not (1 <= len(session_id) <= MAX_SESSION_ID_CHARS):
            raise APIError(f"a session id is 1 to {MAX_SESSION_ID_CHARS} characters", param="session_id")
        try:
            known = await client.ask("session_delete", (salt or "", session_id), timeout=CORE_ANSWER_TIMEOUT)
        except (EngineGone, asyncio.TimeoutError) as e:
            raise APIError(f"engine process unavailable: {str(e) or 'no answer'}", 503, "server_error") from None
        if known is None:
            raise APIError("this engine keeps no prefix cache: it has no sessions", 404, code="session_not_found")
        if not known:
            raise APIError(f"no session {session_id!r}", 404, code="session_not_found", param="session_id")
        return {"id": session_id, "object": "session", "deleted": True}
