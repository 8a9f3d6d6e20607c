"""The messages between the HTTP process and the engine core process, and their byte format.

One small typed class per message kind (a NamedTuple: as cheap to build and read as a tuple,
with names). On the wire a message is its kind's tag followed by its fields, written with
`marshal`: the standard library's fastest format for plain values (ints, floats, strings,
lists, dicts, bytes, None), with no object graph to walk and nothing executed on load (unlike
pickle). Both ends run the same code from the same installation, which is what marshal's format
stability requires. `loads` gives back the typed message; receivers dispatch on its type.

HTTP process -> core                    core -> HTTP process
  Init(args)                              Hello(facts) | Fatal(line) | Refused(line)
  Add(key, rid, prompt ids, params, ...)  Out([output row, ...]): one engine step's outputs
  Abort(key | None, rid | None, ...)      Reply(call id, ok, value | error)
  Finish(key): a stop string ended it here
  Call(call id, name, argument): an RPC (names: engine_core.RPCS)
"""

from __future__ import annotations

import marshal
from dataclasses import fields
from operator import attrgetter
from typing import Any, NamedTuple, Optional, Union

from dsv4_engine.request_output import RequestOutput
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.structured.spec import StructuredSpec


class Init(NamedTuple):
    args: dict  # the ServerArgs' fields


class Hello(NamedTuple):
    facts: dict  # what the HTTP process needs to know of the loaded model


class Fatal(NamedTuple):
    message: str  # the engine could not start


class Refused(NamedTuple):
    message: str  # not servable as asked (one line for the CLI)


class Add(NamedTuple):
    key: int  # the channel's name for the request
    rid: str
    prompt_ids: list
    params: tuple  # params_row(SamplingParams)
    pd: Optional[tuple]  # (bootstrap_host, bootstrap_port, room) on prefill/decode engines
    prefill_only: bool
    arrival: float
    share_prefix_of: Optional[str] = None  # the rid of the request's first choice (n > 1)
    output_ids: list = []  # the answer so far of a migrated request (the router's continuation)
    plain_prompt_ids: Optional[list] = None  # PD decode: the prompt as prefill tokenizes it (chat answer memo)


class Abort(NamedTuple):
    key: Optional[int]  # one request of this channel, or
    rid: Optional[str]  # every request with this rid (the admin's abort), or
    reason: str
    all: bool  # every request


class Finish(NamedTuple):
    key: int  # a stop string ended it in the HTTP process


class Call(NamedTuple):
    call_id: int
    name: str
    arg: Any = None


class Out(NamedTuple):
    rows: list  # output_row(...) per request that produced something in one engine step


class Reply(NamedTuple):
    call_id: int
    ok: bool
    value: Any  # the answer, or (exception class name, message)


Message = Union[Init, Hello, Fatal, Refused, Add, Abort, Finish, Call, Out, Reply]
KINDS: tuple[type, ...] = (Init, Hello, Fatal, Refused, Add, Abort, Finish, Call, Out, Reply)  # index = tag
_TAG = {kind: tag for tag, kind in enumerate(KINDS)}
_PARAM_FIELDS = tuple(f.name for f in fields(SamplingParams))
# An output row is the key, then RequestOutput's fields after rid, in the dataclass's own order.
OUTPUT_FIELDS = tuple(f.name for f in fields(RequestOutput))[1:]


def dumps(msg: Message) -> bytes:
    return marshal.dumps((_TAG[type(msg)], *msg))


def loads(data: bytes) -> Message:
    tag, *values = marshal.loads(data)
    return KINDS[tag](*values)


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


def add_msg(
    key: int,
    rid: str,
    prompt_ids: list[int],
    params: SamplingParams,
    pd: Optional[tuple],
    prefill_only: bool,
    arrival: float,
    share_prefix_of: Optional[str] = None,
    output_ids: Optional[list[int]] = None,
    plain_prompt_ids: Optional[list[int]] = None,
) -> Add:
    return Add(
        key,
        rid,
        prompt_ids,
        params_row(params),
        pd,
        prefill_only,
        arrival,
        share_prefix_of,
        list(output_ids or ()),
        list(plain_prompt_ids) if plain_prompt_ids is not None else None,
    )


_output_values = attrgetter(*OUTPUT_FIELDS)  # C-speed: one engine step may carry hundreds of rows


def output_row(key: int, out: RequestOutput) -> tuple:
    return (key, *_output_values(out))


def output_of(row: tuple, rid: str) -> tuple[int, RequestOutput]:
    key, *rest = row
    return key, RequestOutput(rid, *rest)  # positional is safe: OUTPUT_FIELDS follows the dataclass


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


def reply_error(call_id: int, e: BaseException) -> Reply:
    return Reply(call_id, False, (type(e).__name__, str(e)))


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
