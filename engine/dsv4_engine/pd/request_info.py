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
    handle: Optional[int] = None  # prefill: the KV transfer
    transfer_started: Optional[float] = None

    @property
    def bootstrap_addr(self) -> str:
        return f"http://{self.bootstrap_host}:{self.bootstrap_port}"

    def enter(self, state: PDState, timeout: Optional[float], now: float) -> None:
        self.state = state
        self.entered = now
        self.deadline = None if timeout is None else now + timeout

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline
