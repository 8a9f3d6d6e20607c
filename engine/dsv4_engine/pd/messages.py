"""What PD peers say to each other, one typed class per message, built and checked here only.

decode -> prefill   RegisterRoom (POST bootstrap/register; answered with the prefill's boot id),
                    AbortRoom (POST bootstrap/abort), heartbeats (GET, the decode's boot id)
prefill -> decode   TransferNote (the notification that lands with the KV: first token, cached
                    prompt tokens, optional logprobs and region checksums; one per decode rank,
                    naming the rank), AbortRoom (POST pd/abort)

Each class turns itself into its JSON form (`wire`) and back (`of`), and `of` is the one place
a peer's message is validated: a malformed one is a ValueError naming the field.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Optional


def _int(body: Mapping[str, Any], name: str, minimum: Optional[int] = None) -> int:
    value = body.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or (minimum is not None and value < minimum):
        raise ValueError(
            f"{name} must be an integer{f' >= {minimum}' if minimum is not None else ''}, got {value!r:.40}"
        )
    return value


def _str(body: Mapping[str, Any], name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {value!r:.40}")
    return value


def _ids(value: Any) -> Optional[list[int]]:
    if value is None:
        return None
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
    ):
        raise ValueError(f"prompt_ids must be a non-empty list of token ids, got {value!r:.40}")
    return list(value)


def _object(body: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise ValueError(f"{what} must be a JSON object, got {body!r:.40}")
    return body


@dataclass(frozen=True)
class RegisterRoom:
    """Decode -> prefill: the pages (and slot row) reserved for `room`, and how to reach decode."""

    room: int
    rid: str
    desc: dict  # the decode transport's descriptor (where to write)
    dst_pages: list[int]
    decode_url: str  # where prefill sends AbortRoom
    decode_boot: str  # the decode process's boot id (a restarted peer is a different peer)
    dst_slot: Optional[int] = None  # the decode's slot row (models with slot states)
    checksum: bool = False  # decode verifies region checksums
    # decode serves this room from its own prefix cache (pd.continuation): prefill drops it,
    # computing and sending nothing
    local: bool = False
    # decode's prompt ids when they differ from what prefill tokenized (chat answers spliced as
    # their generated ids, dsv4_serve.chat.answer_memo): prefill computes these instead
    prompt_ids: Optional[list[int]] = None
    # a decode over several ranks: the transport descriptors of its ranks 1.., each with its own
    # pool (the same page ids and slot row as `desc`'s); prefill writes each rank's share into it
    rank_descs: list[dict] = field(default_factory=list)
    # a decode with data-parallel attention (--dp-size N): the rank whose pool `desc` is and
    # `dst_pages` (local to that pool) are; prefill names it in its notification (pd.dp_handoff)
    decode_dp_rank: Optional[int] = None

    def wire(self) -> dict:
        return asdict(self)

    @classmethod
    def of(cls, body: Any) -> "RegisterRoom":
        body = _object(body, "a registration")
        pages = body.get("dst_pages")
        if not isinstance(pages, list) or not all(
            isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in pages
        ):
            raise ValueError(f"dst_pages must be a list of page numbers, got {pages!r:.40}")
        slot = body.get("dst_slot")
        if slot is not None:
            slot = _int(body, "dst_slot", 0)
        desc = body.get("desc")
        if not isinstance(desc, dict):
            raise ValueError(f"desc must be a JSON object, got {desc!r:.40}")
        rid = body.get("rid", "")
        rank_descs = body.get("rank_descs", [])
        if not isinstance(rank_descs, list) or not all(isinstance(d, dict) for d in rank_descs):
            raise ValueError(f"rank_descs must be a list of JSON objects, got {rank_descs!r:.40}")
        return cls(
            room=_int(body, "room"),
            rid=rid if isinstance(rid, str) else str(rid),
            desc=desc,
            dst_pages=list(pages),
            decode_url=_str(body, "decode_url"),
            decode_boot=_str(body, "decode_boot"),
            dst_slot=slot,
            checksum=bool(body.get("checksum", False)),
            local=body.get("local", False) is True,
            prompt_ids=_ids(body.get("prompt_ids")),
            rank_descs=list(rank_descs),
            decode_dp_rank=None if body.get("decode_dp_rank") is None else _int(body, "decode_dp_rank", 0),
        )


WRITES_EVERY_RANK = "writes_every_rank"  # in prefill's answer to a registration: it honours rank_descs
NAMES_DP_RANK = "names_dp_rank"  # ... and it names decode_dp_rank in its notification (pd.dp_handoff)


def registration_answer(boot_id: str) -> dict:
    """Prefill -> decode, the answer to RegisterRoom: its process identity, that it writes into
    every decode rank the registration names, and that its notification names a DP decode's rank."""
    return {"ok": True, "boot_id": boot_id, WRITES_EVERY_RANK: True, NAMES_DP_RANK: True}


@dataclass(frozen=True)
class AbortRoom:
    """Either way: drop this room (its request failed or was aborted on the sender's side)."""

    room: int
    reason: str = "aborted by peer"

    def wire(self) -> dict:
        return asdict(self)

    @classmethod
    def of(cls, body: Any) -> "AbortRoom":
        body = _object(body, "an abort")
        reason = body.get("reason", "aborted by peer")
        return cls(_int(body, "room"), reason if isinstance(reason, str) else str(reason))


@dataclass(frozen=True)
class TransferNote:
    """Prefill -> decode, landing with the KV: the request's first token and what came with it."""

    room: int
    token: int
    prefill_boot: str = ""
    cached_tokens: int = 0  # prompt tokens prefill's prefix cache served (usage.cached_tokens)
    logprobs: Optional[dict] = None  # the first token's logprobs entry, when asked
    checksums: Optional[dict] = None  # region -> checksum (--transfer-checksum)
    rank: int = 0  # the decode rank whose share landed (a decode over several ranks hears one per rank)
    prefill_dp_rank: Optional[int] = None  # a prefill with data-parallel attention: the rank whose pool was read

    def encode(self) -> bytes:
        return json.dumps({k: v for k, v in asdict(self).items() if v is not None and (k != "rank" or v)}).encode()

    @classmethod
    def decode(cls, data: bytes) -> "TransferNote":
        try:
            body = json.loads(data)
        except ValueError as e:
            raise ValueError(f"a notification must be JSON: {e}") from None
        body = _object(body, "a notification")
        cached = body.get("cached_tokens", 0)
        checksums = body.get("checksums")
        if checksums is not None and not isinstance(checksums, dict):
            raise ValueError(f"checksums must be a JSON object, got {checksums!r:.40}")
        logprobs = body.get("logprobs")
        boot = body.get("prefill_boot", "")
        return cls(
            room=_int(body, "room"),
            token=_int(body, "token", 0),
            prefill_boot=boot if isinstance(boot, str) else str(boot),
            cached_tokens=cached if isinstance(cached, int) and not isinstance(cached, bool) and cached >= 0 else 0,
            logprobs=logprobs if isinstance(logprobs, dict) else None,
            checksums=checksums,
            rank=_int(body, "rank", 0) if "rank" in body else 0,
            prefill_dp_rank=_int(body, "prefill_dp_rank", 0) if body.get("prefill_dp_rank") is not None else None,
        )
