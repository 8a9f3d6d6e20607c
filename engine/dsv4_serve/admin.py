"""Admin-surface helpers shared by the engine's routes: the token check and thread stacks."""

from __future__ import annotations

import sys
import threading
import traceback
from typing import Optional

from fastapi import Request
from fastapi.responses import JSONResponse

from dsv4_wire import APIError, admin_refusal, token_matches


RETRY_AFTER_S = 1  # a full queue (429) empties in about a step or a few: retry soon


def error_response(e: APIError) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if e.status == 429 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def require_admin(http: Request, token: Optional[str]) -> None:
    """The admin rule every dsv4 surface shares (dsv4_wire.admin_refusal): the token when one is
    set, else loopback clients only."""
    refusal = admin_refusal(http.headers, token, http.client.host if http.client else None)
    if refusal is not None:
        status, message = refusal
        raise APIError(message, status, "authentication_error" if status == 401 else "permission_error")


def require_token(http: Request, token: Optional[str], what: str = "admin token") -> None:
    """Raise a 401 unless the request carries `Authorization: Bearer <token>` (or none is set):
    the rule of engine-to-engine PD endpoints, whose peers are other hosts."""
    if not token_matches(http.headers, token):
        raise APIError(f"{what} required", 401, "authentication_error")


def thread_stacks() -> str:
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"--- thread {names.get(ident, '?')} ({ident}) ---\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)
