"""Input hygiene for request bodies, before anything is routed: a size limit, JSON that Python
would accept but an engine must not see (NaN, Infinity, numbers that overflow to infinity,
integers too long to convert), nesting deep enough to exhaust the parser's recursion, and a
top level that is not an object. Every refusal is an APIError (413 or 400)."""

from __future__ import annotations

import json
import math
from typing import AsyncIterator, Optional

from dsv4_wire import APIError

MAX_DEPTH = 64  # chat messages with content parts nest about 5 deep


def _finite_float(s: str) -> float:
    x = float(s)
    if not math.isfinite(x):
        raise ValueError(f"number {s[:40]} is out of range")
    return x


def _no_constant(s: str):
    raise ValueError(f"{s} is not a valid JSON number")


def _depth_ok(obj, limit: int) -> bool:
    """Iterative, so it cannot itself hit the recursion limit."""
    stack = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, (dict, list)):
            if d > limit:
                return False
            stack.extend((v, d + 1) for v in (o.values() if isinstance(o, dict) else o))
    return True


def _lone_surrogate(obj) -> bool:
    """Whether any string (key or value) holds a lone UTF-16 surrogate: JSON's \\ud800 escapes
    decode to one in Python, but it is no character, cannot be encoded as UTF-8 to forward, and
    the engines refuse it (400)."""
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, str):
            try:
                o.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(o, dict):
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, list):
            stack.extend(o)
    return False


def parse_body(raw: bytes, max_depth: int = MAX_DEPTH) -> dict:
    """The request's JSON object, or APIError(400). Pure."""
    try:
        body = json.loads(raw, parse_float=_finite_float, parse_constant=_no_constant)
    except RecursionError:
        raise APIError(f"request body nests deeper than {max_depth} levels") from None
    except UnicodeDecodeError as e:
        raise APIError(f"request body is not valid UTF-8: {e}") from None
    except ValueError as e:  # JSONDecodeError, non-finite numbers, over-long integers
        raise APIError(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError("request body must be a JSON object")
    if not _depth_ok(body, max_depth):
        raise APIError(f"request body nests deeper than {max_depth} levels")
    if _lone_surrogate(body):
        raise APIError(
            "request body is not valid JSON: a string holds a lone surrogate escape (\\ud800-\\udfff "
            "without its pair), which is no Unicode character"
        )
    return body


def too_large(max_bytes: int) -> APIError:
    return APIError(
        f"request body is larger than {max_bytes} bytes", 413, "invalid_request_error", code="request_too_large"
    )


async def read_limited(content_length: Optional[str], chunks: AsyncIterator[bytes], max_bytes: int) -> bytes:
    """The body, refusing (413) as soon as it is known to exceed max_bytes: from Content-Length
    before reading anything, else while reading."""
    if content_length is not None:
        try:
            if int(content_length) > max_bytes:
                raise too_large(max_bytes)
        except ValueError:
            raise APIError("Content-Length is not a number") from None
    buf = bytearray()
    async for chunk in chunks:
        buf += chunk
        if len(buf) > max_bytes:
            raise too_large(max_bytes)
    return bytes(buf)
