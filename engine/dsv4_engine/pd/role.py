"""The hooks the engine loop calls on its PD role controller (prefill or decode)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from dsv4_engine.metrics import EngineMetrics
    from dsv4_engine.sequence import Sequence


class RoleController(Protocol):
    def on_new(self, seq: "Sequence") -> None:
        """A request arrived (engine thread): the controller owns it until it schedules it."""

    def busy(self) -> bool:
        """True while transfers or peers are pending: the loop then polls without sleeping."""

    def poll(self) -> None:
        """Once per loop iteration: advance transfers, notifications, deadlines, heartbeats."""

    def on_prefill_done(self, seq: "Sequence") -> None:
        """Prefill: the first token is sampled; hand the request's state to decode."""

    def on_finish(self, seq: "Sequence") -> None:
        """The request ends (any reason): leave every queue, tell the peer when it must know."""

    def abort_room(self, room: int, reason: str) -> None:
        """The peer gave up on this room (engine thread)."""

    def update_gauges(self, metrics: "EngineMetrics") -> None: ...

    def loads(self) -> tuple[dict, dict]:
        """(queue sizes, extra fields) for /v1/loads."""

    def waiting(self) -> int:
        """Requests in its queues before the forward (--max-queued-requests counts them)."""

    def close(self) -> None: ...
