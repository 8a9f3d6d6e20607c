"""Server-sent events both ways: the chat stream read as JSON chunks, the agent APIs' named
events written. Pure."""

from __future__ import annotations

import json
from typing import Optional, Union

DONE = "[DONE]"


def named_event(obj: dict) -> bytes:
    """One event of the Responses and Messages streams: `event:` is the object's `type`."""
    return f"event: {obj['type']}\ndata: {json.dumps(obj, allow_nan=False)}\n\n".encode()


def split_events(buf: bytes) -> tuple[list[bytes], bytes]:
    """(the whole events at the front of buf, the partial rest)."""
    cut = buf.rfind(b"\n\n")
    if cut < 0:
        return [], buf
    return [e for e in buf[:cut].split(b"\n\n") if e.strip()], buf[cut + 2 :]


def chat_event(event: bytes) -> Optional[Union[dict, str]]:
    """A chat stream event's data: a chunk (or error) dict, DONE, or None for a comment or a
    line that is no JSON object."""
    data = b"".join(line[5:].lstrip() for line in event.split(b"\n") if line.startswith(b"data:"))
    if not data:
        return None
    if data.strip() == DONE.encode():
        return DONE
    try:
        obj = json.loads(data)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None
