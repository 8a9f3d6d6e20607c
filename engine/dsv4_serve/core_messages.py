"""The messages between the HTTP process and the engine core process, and their byte format.

Every message is a tuple of plain values (ints, floats, strings, lists, dicts, bytes, None)
written with `marshal`: the standard library's fastest format for exactly those types, with
no object graph to walk and nothing executed on load (unlike pickle). Both ends run the same
code from the same installation, which is what marshal's format stability requires. A request
travels as its token ids and sampling parameters; an output as its new token ids, text delta
and the ending. Outputs of one engine step go out together as one message.

HTTP process -> core                          core -> HTTP process
  (INIT, server args)                           (HELLO, facts) | (FATAL, one line)
                                                | (REFUSED, one line): not servable as asked
  (ADD, key, rid, prompt ids, params, pd,       (OUT, [output row, ...])
   prefill_only, arrival, share_prefix_of)      (REPLY, call id, ok, value | error)
  (ABORT, key | None, rid | None, reason, all)
  (FINISH, key): a stop string ended it here
  (RPC, call id, name, argument)
"""

from __future__ import annotations

import marshal
from dataclasses import fields
from typing import Any, Optional

from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.structured.spec import StructuredSpec
from dsv4_engine.request_output import RequestOutput

INIT, HELLO, FATAL, ADD, ABORT, RPC, OUT, REPLY, FINISH, REFUSED = range(10)
_PARAM_FIELDS = tuple(f.name for f in fields(SamplingParams))


def dumps(msg: tuple) -> bytes:
    return marshal.dumps(msg)


def loads(data: bytes) -> tuple:
    return marshal.loads(data)


def params_row(p: SamplingParams) -> tuple:
    row = tuple(getattr(p, name) for name in _PARAM_FIELDS)
    if p.structured is not None:  # a dataclass: marshal writes only plain values
        row = tuple(p.structured.row() if name == "structured" else v for name, v in zip(_PARAM_FIELDS, row))
    return row


def params_of(row: tuple) -> SamplingParams:
    kw = dict(zip(_PARAM_FIELDS, row))
    if kw.get("structured") is not None:
        kw["structured"] = StructuredSpec.of_row(kw["structured"])
    return SamplingParams(**kw)


def add_msg(key: int, rid: str, prompt_ids: list[int], params: SamplingParams, pd: Optional[tuple],
            prefill_only: bool, arrival: float, share_prefix_of: Optional[str] = None,
            output_ids: Optional[list[int]] = None) -> tuple:
    """pd: (bootstrap_host, bootstrap_port, room) for prefill/decode engines, else None;
    share_prefix_of: the rid of the request's first choice when this is another one (n > 1);
    output_ids: the answer so far of a migrated request (the router's continuation)."""
    return (ADD, key, rid, prompt_ids, params_row(params), pd, prefill_only, arrival, share_prefix_of,
            list(output_ids or ()))


def output_row(key: int, out: RequestOutput) -> tuple:
    return (key, out.token_ids, out.text, out.finished, out.finish_reason, out.error, out.error_code,
            out.prompt_tokens, out.completion_tokens, out.logprobs, out.cached_tokens)


def output_of(row: tuple, rid: str) -> tuple[int, RequestOutput]:
    key, *rest = row
    return key, RequestOutput(rid, *rest)


def plain(value: Any) -> Any:
    """`value` in types marshal writes: numpy/torch scalars become Python numbers, tuples and sets
    lists, anything else its text (for RPC answers such as /v1/loads that code elsewhere fills)."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [plain(v) for v in value]
    item = getattr(value, "item", None)
    if callable(item):
        try:
            return plain(item())
        except (TypeError, ValueError, RuntimeError):
            pass
    return str(value)


def reply_error(call_id: int, e: BaseException) -> tuple:
    return (REPLY, call_id, False, (type(e).__name__, str(e)))


class RemoteError(Exception):
    """An RPC that raised in the engine core; `kind` is the exception's class name there."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def raise_remote(value: Any) -> None:
    kind, message = value
    # The core's ValueError/KeyError/TypeError stay what they were: callers catch those (bad input).
    builtin = {"ValueError": ValueError, "KeyError": KeyError, "TypeError": TypeError}.get(kind)
    if builtin is not None:
        raise builtin(message)
    raise RemoteError(kind, message)
