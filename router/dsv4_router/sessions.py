"""Sessions at the router (dsv4_engine.session_pins is the engines' side): a conversation named
by the `x-session-id` header reaches prefill and decode as the body's `prompt_cache_key` (the
field wins when both are given), and `x-session-ttl` as `session_ttl`, so every engine of its
path keys the session alike (the tenant being the cache salt, which the router derives from the
API key under --cache-salt-from-api-key). DELETE /v1/sessions/{id} goes to every engine and
answers 200 when one knew the session, 404 when none did."""

from __future__ import annotations

import asyncio
from typing import Mapping, Optional

import httpx

from dsv4_router.tenancy import derived_salt
from dsv4_wire import APIError, Paths

SESSION_HEADER = "x-session-id"
SESSION_TTL_HEADER = "x-session-ttl"


def session_into_body(body: dict, headers: Mapping[str, str]) -> None:
    """The session headers as the body's fields (a field the client gave wins)."""
    name = headers.get(SESSION_HEADER)
    if name is not None and "prompt_cache_key" not in body:
        body["prompt_cache_key"] = name
    ttl = headers.get(SESSION_TTL_HEADER)
    if ttl is not None and "session_ttl" not in body:
        body["session_ttl"] = ttl


def delete_verdict(statuses: list[Optional[int]]) -> int:
    """The router's answer to a DELETE from its engines' (None: unreachable): 200 if one ended
    the session, else 404 if one answered that it has none, else 503."""
    if any(s == 200 for s in statuses):
        return 200
    if any(s == 404 for s in statuses):
        return 404
    if any(s is not None and 400 <= s < 500 for s in statuses):
        return next(s for s in statuses if s is not None and 400 <= s < 500)
    return 503


async def delete_session(
    client: httpx.AsyncClient, urls: list[str], session_id: str, client_salt: Optional[str], key, salt_from_key: bool
) -> tuple[int, dict]:
    salt = derived_salt(key, client_salt) if salt_from_key and key is not None else client_salt
    params = {"cache_salt": salt} if salt else {}

    async def one(url: str) -> Optional[int]:
        try:
            r = await client.delete(f"{url}{Paths.SESSIONS}/{session_id}", params=params)
            return r.status_code
        except httpx.HTTPError:
            return None

    status = delete_verdict(list(await asyncio.gather(*(one(u) for u in urls))))
    if status == 200:
        return 200, {"id": session_id, "object": "session", "deleted": True}
    if status == 404:
        raise APIError(f"no session {session_id!r}", 404, code="session_not_found", param="session_id")
    if status == 503:
        raise APIError("no engine answered", 503, "service_unavailable")
    raise APIError(f"the engines refused to delete session {session_id!r}", status)
