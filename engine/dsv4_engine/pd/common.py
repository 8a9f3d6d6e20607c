"""What prefill and decode share: per-request PD state with deadlines, the settings both read,
and the controller base that holds the seams (transport, control channel, deadline policy)."""

from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from dsv4_engine.pd.channel import ControlChannel
from dsv4_engine.pd.faults import Deadlines, FaultInjector
from dsv4_engine.pd.request_info import PDRequestInfo, PDState, stuck_first, timeline_view
from dsv4_engine.pd.transport import KVTransport, PoolStates
from dsv4_wire.serve_options import default

# The engine and its Sequence are not imported here, not even for typing: Sequence.pd is typed
# with PDRequestInfo from pd.request_info, and the import graph stays without circles.
Engine = Sequence = Any

log = logging.getLogger("dsv4.pd")

BOOT_ID = uuid.uuid4().hex[:12]  # one per process: a restarted peer is a different peer
HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_MISSES = (
    5  # this many intervals without an answer and the peer is declared dead (3 was too tight on busy 2-core machines)
)

Clock = Callable[[], float]


@dataclass
class PDSettings:
    """The deadlines of each PD state, and (decode) the URL prefill reaches this engine at."""

    bootstrap_timeout: float = default("bootstrap_timeout")
    transfer_timeout: float = default("transfer_timeout")
    waiting_timeout: float = default("waiting_timeout")
    url: str = ""
    transfer_checksum: bool = False  # --transfer-checksum: verify (decode) / always send (prefill) region checksums

    @classmethod
    def from_args(cls, args, environ: Optional[Mapping[str, str]] = None) -> "PDSettings":
        url = advertised_url(
            args.host, args.port, getattr(args, "advertise_host", None), os.environ if environ is None else environ
        )
        return cls(
            args.bootstrap_timeout,
            args.transfer_timeout,
            args.waiting_timeout,
            url,
            bool(getattr(args, "transfer_checksum", False)),
        )


WILDCARD_HOSTS = ("0.0.0.0", "::", "", "[::]")
POD_IP_ENV = "POD_IP"  # what Kubernetes' downward API gives the pod (the operator's manifests set it)


def advertised_url(host: str, port: int, advertise_host: Optional[str], environ: Mapping[str, str]) -> str:
    """Pure: the URL a peer reaches this engine at (decode tells prefill where to send aborts).
    `--advertise-host` wins; else the listen host unless it is a wildcard (0.0.0.0 is every
    address here but the peer's own loopback there); else $POD_IP; else 127.0.0.1, which only a
    peer on this machine reaches (`dsv4 up`)."""
    chosen = advertise_host or (host if host not in WILDCARD_HOSTS else environ.get(POD_IP_ENV) or "127.0.0.1")
    if ":" in chosen and not chosen.startswith("["):  # an IPv6 address in a URL goes in brackets
        chosen = f"[{chosen}]"
    return f"http://{chosen}:{port}"


def fail_request(engine: Engine, seq: Sequence, code: int, msg: str, counter: Optional[str] = None) -> None:
    """End a PD request with an error the client can read; `counter` is the metric it moves."""
    if counter:
        engine.metrics.inc(counter)
    seq.pd.state = PDState.FAILED
    log.warning("request %s room %s failed: %s", seq.rid, seq.pd.room, msg)
    engine.finish(seq, "error", error=msg, error_code=code)


class PDController:
    """What the prefill and decode controllers share: the seams they were given (transport,
    control channel), the deadline policy, the fault injector /admin/faults arms, a clock, and
    the pool's state regions."""

    def __init__(
        self,
        engine: Engine,
        settings: PDSettings,
        transport: KVTransport,
        channel: ControlChannel,
        *,
        deadlines: Optional[Deadlines] = None,
        faults: Optional[FaultInjector] = None,
        boot_id: str = BOOT_ID,
        clock: Clock = time.monotonic,
    ):
        self.engine = engine
        self.settings = settings
        self.transport = transport
        self.channel = channel
        self.faults = faults if faults is not None else FaultInjector()
        self.deadlines = deadlines if deadlines is not None else Deadlines(True, self.faults)
        self.boot_id = boot_id
        self.clock = clock
        self.states = PoolStates.of_pool(engine.pool)  # every region a hand-off moves

    def _timeout(self, seconds: float) -> Optional[float]:
        return self.deadlines.timeout(seconds)

    def _fail(self, seq: Sequence, code: int, msg: str, counter: Optional[str] = None) -> None:
        fail_request(self.engine, seq, code, msg, counter)

    def timelines(self) -> list[dict]:
        """/v1/loads' `requests`: the PD timelines of this engine's requests (stuck ones first),
        read from another thread (a copy of each list; the caller retries a resized dict)."""
        now, wall = self.clock(), time.time()
        last_token = (lambda s: s.last_token_time) if self.clock is time.monotonic else (lambda s: None)
        views = [
            timeline_view(s.rid, s.pd, last_token(s), len(s.output_ids), now, wall, list(s.pd.timeline))
            for s in list(self.engine.seqs.values())
            if isinstance(s.pd, PDRequestInfo)
        ]
        return stuck_first(views)

    def on_prefill_done(self, seq: Sequence) -> None:
        raise RuntimeError(f"{type(self).__name__} does not prefill for a peer")

    def close(self) -> None:
        self.channel.close()
        self.transport.close()
