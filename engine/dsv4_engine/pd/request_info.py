"""A PD request's hand-off record: where its peer is, which state the hand-off is in and the
deadline of that state. Plain data (no torch): the HTTP process builds one to check a PD
request's bootstrap fields (`admission.bootstrap_target`) before the engine core sees it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional


class PDState(enum.Enum):
    BOOTSTRAPPING = "Bootstrapping"
    WAITING_FOR_INPUT = "WaitingForInput"
    TRANSFERRING = "Transferring"
    SUCCESS = "Success"
    FAILED = "Failed"


@dataclass(eq=False)
class PDRequestInfo:
    """Where the request's peer is and how far the hand-off got. Every state has a deadline."""

    bootstrap_host: str
    bootstrap_port: int
    room: int
    state: PDState = PDState.BOOTSTRAPPING
    deadline: Optional[float] = None
    entered: float = 0.0
    peer: Optional[str] = None  # transport name of the other side
    peer_boot: Optional[str] = None
    peer_url: Optional[str] = None  # prefill: the decode to tell when this room fails here
    peer_told: bool = False  # the peer gave up on this room itself: no abort is echoed back
    dst_pages: list[int] = field(default_factory=list)
    dst_slot: Optional[int] = None  # prefill: the decode's slot row (models with slot states)
    checksum: bool = False  # prefill: the decode asked for region checksums with the KV
    handle: Optional[int] = None  # prefill: the KV transfer to decode's rank 0
    # prefill, a decode over several ranks: each rank's peer and transfer (rank 0's first), written
    # straight into that rank's pool (`pd.rank_pools`)
    rank_peers: list[str] = field(default_factory=list)
    handles: list[int] = field(default_factory=list)
    decode_dp_rank: Optional[int] = None  # prefill: a DP decode's rank whose pool the pages land in
    prefill_dp_rank: Optional[int] = None  # prefill at --dp-size N: the rank whose pool the pages are read from
    transfer_started: Optional[float] = None
    # (event, clock time): every state entered and the hand-off's milestones, for the watchdog's
    # evidence (`timeline_view`); a few entries per request, appended on the engine thread
    timeline: list[tuple[str, float]] = field(default_factory=list)

    @property
    def bootstrap_addr(self) -> str:
        return f"http://{self.bootstrap_host}:{self.bootstrap_port}"

    def enter(self, state: PDState, timeout: Optional[float], now: float) -> None:
        self.state = state
        self.entered = now
        self.deadline = None if timeout is None else now + timeout
        self.mark(state.value, now)

    def mark(self, event: str, now: float) -> None:
        self.timeline.append((event, now))

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline


# At most this many requests' timelines in /v1/loads (the longest-waiting first).
TIMELINE_REQUESTS = 32


def timeline_view(
    rid: str,
    pd: PDRequestInfo,
    last_token_time: Optional[float],
    tokens: int,
    now: float,
    wall_now: float,
    events: Optional[list[tuple[str, float]]] = None,
) -> dict:
    """One PD request's timeline as /v1/loads shows it: each event's age (seconds before `now`)
    and wall-clock time, the state it is in and for how long, and how long since it last made
    progress (an event or a token). Pure."""
    events = pd.timeline if events is None else events
    last = max([t for _, t in events] + ([last_token_time] if last_token_time is not None else []), default=now)
    return {
        "rid": rid,
        "room": pd.room,
        "state": pd.state.value,
        "peer": pd.peer_url,
        "in_state_seconds": round(now - pd.entered, 3),
        "deadline_in_seconds": None if pd.deadline is None else round(pd.deadline - now, 3),
        "output_tokens": tokens,
        "last_progress_seconds_ago": round(now - last, 3),
        "events": [
            {"event": e, "seconds_ago": round(now - t, 3), "at": round(wall_now - (now - t), 3)} for e, t in events
        ],
    }


def stuck_first(views: list[dict], limit: int = TIMELINE_REQUESTS) -> list[dict]:
    """The timelines most worth a look: requests still in a hand-off state before those that
    finished theirs, then the longest without progress. Pure."""
    done = (PDState.SUCCESS.value,)
    return sorted(views, key=lambda v: (v["state"] in done, -v["last_progress_seconds_ago"]))[:limit]
