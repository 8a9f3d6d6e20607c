"""The id a request runs under (its `rid`, the response's `id`), made by the router.

A client's own `rid` (SGLang's field) reached the engines as it was: a predictable id made
another client's request fail as a duplicate, and a newline in it forged router log lines
(issue 39). The router now makes every id unique itself; a client's `rid` is kept only as the
id's prefix, and only from a short, log-safe alphabet (else the request is a 400).
"""

from __future__ import annotations

import os
import re
from typing import Optional

from dsv4_wire import APIError

MAX_CLIENT_RID_CHARS = 64
_SAFE = re.compile(r"[A-Za-z0-9._:-]+")


def request_id(client_rid: object, chat: bool, unique: Optional[str] = None) -> str:
    """Pure (given `unique`): the id of one request. APIError (400) for a client `rid` that is
    not a string of 1..64 characters from A-Z a-z 0-9 . _ : -."""
    unique = unique or os.urandom(16).hex()  # as random as uuid4's, without building a UUID per request
    if client_rid is None:
        return f"{'chatcmpl' if chat else 'cmpl'}-{unique}"
    if not isinstance(client_rid, str) or len(client_rid) > MAX_CLIENT_RID_CHARS or not _SAFE.fullmatch(client_rid):
        raise APIError(
            f"rid must be 1 to {MAX_CLIENT_RID_CHARS} characters from A-Z, a-z, 0-9, '.', '_', ':' and '-'",
            400,
            "invalid_request_error",
            param="rid",
        )
    return f"{client_rid}-{unique}"
