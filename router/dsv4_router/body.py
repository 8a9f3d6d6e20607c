"""Input hygiene for request bodies, before anything is routed: a size limit, JSON that Python
would accept but an engine must not see (NaN, Infinity, numbers that overflow to infinity,
integers too long to convert), nesting deep enough to exhaust the parser's recursion, and a
top level that is not an object. Every refusal is an APIError (413 or 400)."""

from __future__ import annotations

import json
import math
import re
from typing import AsyncIterator, Iterable, Optional

from dsv4_wire import APIError

MAX_DEPTH = 64  # chat messages with content parts nest about 5 deep
# Arrays and objects in one body at most: a chat of many messages with tools is a few thousand;
# a 16 MiB body of 3 million small arrays held the router's event loop for 11 s (issue 39).
MAX_CONTAINERS = 65536
_NOT_STRUCTURE = bytes(c for c in range(256) if c not in b'[]{}"')
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
# The body limit derived from the engines' context length (no --max-body-bytes): room for a
# prompt of max_model_len tokens written as JSON-escaped text, plus a chat's other fields.
BYTES_PER_TOKEN = 32
BODY_OVERHEAD = 1 << 20
MAX_DERIVED_BODY = 16 << 20


def body_limit(configured: Optional[int], context_lengths: Iterable[Optional[int]]) -> int:
    """Pure: --max-body-bytes when given, else derived from the largest context length the
    engines report (16 MiB until one has)."""
    if configured is not None:
        return configured
    known = [n for n in context_lengths if isinstance(n, int) and n > 0]
    if not known:
        return MAX_DERIVED_BODY
    return min(MAX_DERIVED_BODY, BODY_OVERHEAD + BYTES_PER_TOKEN * max(known))


def prescan(raw: bytes, max_depth: int = MAX_DEPTH, max_containers: int = MAX_CONTAINERS) -> None:
    """APIError(400) for a body that nests deeper than max_depth or holds more than
    max_containers arrays and objects, from its bytes alone (byte operations in C, then a loop
    over at most 2 x max_containers brackets; no JSON parse): what json.loads would spend seconds
    building. Brackets inside strings do not count."""
    # escaped backslashes, then escaped quotes (neither ends a string), then all but brackets and
    # quotes; what is left between quotes was inside strings
    unescaped = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    structure = b"".join(unescaped.translate(None, _NOT_STRUCTURE).split(b'"')[::2])
    if structure.count(b"[") + structure.count(b"{") > max_containers or len(structure) > 2 * max_containers:
        raise APIError(f"request body holds more than {max_containers} arrays and objects")
    depth = 0
    for c in structure:
        depth += 1 if c in (91, 123) else -1  # [ {
        if depth > max_depth:
            raise APIError(f"request body nests deeper than {max_depth} levels")


def _finite_float(s: str) -> float:
    x = float(s)
    if not math.isfinite(x):
        raise ValueError(f"number {s[:40]} is out of range")
    return x


def _no_constant(s: str):
    raise ValueError(f"{s} is not a valid JSON number")


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
    prescan(raw, max_depth)
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
    if _SURROGATE_ESCAPE.search(raw) and _lone_surrogate(body):  # only a \uD8xx-\uDFxx escape makes one
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
