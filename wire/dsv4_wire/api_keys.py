"""Client API keys on the OpenAI surface, as vLLM's `--api-key`: `Authorization: Bearer <key>`
(or Anthropic's `x-api-key: <key>`) on /v1/* (completions, chat, responses, messages, models);
/health, /ready, /metrics and the live /v1/loads stay open as vLLM's health and metrics do (the
operator and load balancers read them).

Keys come from `--api-key KEY` (repeatable) and `--api-key-file PATH` (one key per line, or
`NAME KEY` to name it in metrics; `#` starts a comment). Metrics never carry a key: a named key
is its name, an unnamed one `key-` and the first 12 hex digits of its SHA-256.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Optional

from dsv4_wire.auth import bearer_token
from dsv4_wire.paths import ANTHROPIC_PATHS, Paths

# Open, as vLLM leaves health and metrics open; /v1/loads is the operator's live view (the
# admin token guards it where one is set).
OPEN_V1_PATHS = frozenset({Paths.LOADS})


def key_id(key: str) -> str:
    """A metrics-safe label for an unnamed key (no key can be recovered from it)."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class ApiKey:
    name: str  # what metrics and logs say
    key: str


def parse_key_lines(text: str, source: str = "") -> list[ApiKey]:
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) > 2:
            raise ValueError(f"{source}:{n}: a line is KEY or NAME KEY")
        name, key = (parts[0], parts[1]) if len(parts) == 2 else (None, parts[0])
        out.append(ApiKey(name or key_id(key), key))
    return out


def load_api_keys(keys: Iterable[str] = (), files: Iterable[str] = ()) -> list[ApiKey]:
    """The keys of the flags; ValueError (one line) for an unreadable file or a duplicate."""
    out = [ApiKey(key_id(k), k) for k in keys if k]
    for f in files:
        try:
            text = Path(f).read_text()
        except OSError as e:
            raise ValueError(f"--api-key-file {f}: {e.strerror or e}") from None
        out.extend(parse_key_lines(text, f))
    seen: set[str] = set()
    for k in out:
        if k.key in seen:
            raise ValueError(f"API key {k.name} is given twice")
        seen.add(k.key)
    return out


class KeyRing:
    """Which configured key a request carries. ``internal``: a token that also passes (the PD
    secret, with which the router speaks to engines), reported as the name ``internal``."""

    def __init__(self, keys: Iterable[ApiKey], internal: Optional[str] = None):
        self.keys = [(k.key.encode(), k) for k in keys]
        self.internal = internal

    def __bool__(self) -> bool:
        return bool(self.keys)

    def identify(self, headers: Mapping[str, str]) -> Optional[ApiKey]:
        # Anthropic's clients send `x-api-key`; OpenAI's `Authorization: Bearer`. Either, on every route.
        got = bearer_token(headers) or headers.get("x-api-key") or None
        if got is None:
            return None
        raw = got.encode()
        found = None
        for key, k in self.keys:  # every key compared, in constant time each
            if hmac.compare_digest(raw, key):
                found = k
        if found is None and self.internal and hmac.compare_digest(raw, self.internal.encode()):
            found = ApiKey("internal", self.internal)
        return found


def protected(path: str) -> bool:
    return path.startswith("/v1/") and path not in OPEN_V1_PATHS


NEEDS_KEY = "a valid API key is required (Authorization: Bearer <key>, or x-api-key: <key>)"
UNAUTHORIZED = json.dumps(
    {"error": {"message": NEEDS_KEY, "type": "authentication_error", "param": None, "code": "invalid_api_key"}}
).encode()
# /v1/messages answers in Anthropic's error shape, its refusals at the door too
UNAUTHORIZED_ANTHROPIC = json.dumps(
    {"type": "error", "error": {"type": "authentication_error", "message": NEEDS_KEY}}
).encode()


SCOPE_KEY = "dsv4.api_key"  # where ApiKeyGate leaves the caller's key in the ASGI scope


def caller_key(scope: dict) -> Optional[ApiKey]:
    """The key ApiKeyGate found for this request (None without keys)."""
    return scope.get(SCOPE_KEY)


def caller_name(scope: dict) -> str:
    """The caller's key name, or "" without keys (what stored responses and sessions belong to)."""
    key = caller_key(scope)
    return key.name if key is not None else ""


class ApiKeyGate:
    """ASGI middleware: requests to protected paths need a key of the ring (401 otherwise); the
    key found is left in the scope (`caller_key`) for what comes after (limits, metrics)."""

    def __init__(self, app, ring: KeyRing):
        self.app = app
        self.ring = ring

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.ring or scope["method"] == "OPTIONS" or not protected(scope["path"]):
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers") or []}
        found = self.ring.identify(headers)
        if found is None:
            body = UNAUTHORIZED_ANTHROPIC if scope["path"] in ANTHROPIC_PATHS else UNAUTHORIZED
            await send(
                {
                    "type": "http.response.start",
                    "status": 401,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                        (b"www-authenticate", b"Bearer"),
                    ],
                }
            )
            return await send({"type": "http.response.body", "body": body})
        scope[SCOPE_KEY] = found
        return await self.app(scope, receive, send)
