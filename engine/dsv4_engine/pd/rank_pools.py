"""PD into a decode over several tensor-parallel ranks: every rank's pool receives its share
straight from prefill, over its own NIXL agent.

Every decode rank keeps the whole state of each request today (the MLA latent and V4's single
KV head, window rings and compressor stages are replicated; only weights are split), in a pool
that mirrors rank 0's page for page and row for row. So each rank registers its own pool with
its own agent, rank 0 names those agents in the registration (`RegisterRoom.rank_descs`), and
prefill writes the request's pages and slot row from its rank 0's pool into every decode rank's
pool, one transfer and one notification per rank (`TransferNote.rank`). The prefill's own TP size
does not matter: its rank 0 holds the whole state too. (Before, decode's rank 0 received alone
and broadcast the pages to its other ranks on the engine thread.)

A rank other than 0 runs no scheduler: a thread of it (`RankRelay`) reads its agent's
notifications and relays each to rank 0's agent unchanged. Rank 0 lands a request once every
rank's notification is in (`missing_ranks`); a rank whose write fails fails the request on
prefill, which tells decode (pages freed on both sides), and one whose notification never comes
is caught by decode's waiting deadline, which names the missing ranks.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Iterable, Mapping, Optional, Union

from dsv4_engine.pd.messages import WRITES_EVERY_RANK

log = logging.getLogger("dsv4.pd.ranks")

RELAY_IDLE_S = 0.002  # a rank's relay thread sleeps this long when nothing arrived


def rank_refusal(answer: Mapping[str, Any], num_ranks: int) -> Optional[str]:
    """Why a decode of `num_ranks` ranks cannot use the prefill that gave `answer`, or None: a
    prefill of an earlier release writes rank 0's pool only, and the request would wait for the
    other ranks' notifications until its deadline."""
    if num_ranks > 1 and answer.get(WRITES_EVERY_RANK) is not True:
        return (
            f"prefill writes into decode's rank 0 only (an earlier release); this decode's {num_ranks} "
            "ranks each need their share: run prefill and decode of one release"
        )
    return None


def missing_ranks(arrived: Mapping[int, Any], ranks: Union[int, Iterable[int]]) -> list[int]:
    """The decode ranks (`ranks` of them, or those listed) whose share of a request has not
    landed yet (their notification)."""
    return [r for r in (range(ranks) if isinstance(ranks, int) else ranks) if r not in arrived]


class RankRelay:
    """On decode rank r > 0: this rank's pool behind its own NIXL agent, and a thread that relays
    every notification the agent receives (prefill's, one per request) to rank 0's agent."""

    def __init__(self, agent, rank0_desc: dict, thread: bool = True):
        self.agent = agent
        self.rank0 = agent.add_peer(rank0_desc)
        self.relayed = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        if thread:  # (tests drive `relay_once` themselves)
            self._thread = threading.Thread(target=self._run, name="dsv4-pd-relay", daemon=True)
            self._thread.start()

    @classmethod
    def start(cls, pool, rank: int, gather: Callable[[dict], list[dict]]) -> "RankRelay":
        """Register `pool` with a new agent, swap descriptors with every rank (`gather`: this
        rank's in, every rank's out, rank 0's first), and start relaying."""
        from dsv4_engine.pd.common import BOOT_ID
        from dsv4_engine.pd.nixl.agent import KVTransferAgent
        from dsv4_engine.pd.transport import PoolStates

        agent = KVTransferAgent(f"decode-{BOOT_ID}-rank{rank}", PoolStates.of_pool(pool), default_timeout_s=None)
        descs = gather(agent.descriptor())
        return cls(agent, descs[0])

    def relay_once(self) -> int:
        """Relay what arrived since the last call; how many notifications that was."""
        got = self.agent.poll_notifs()  # also what lets prefill's connection to us progress
        for _peer, msg in got:
            if self.agent.send_notif(self.rank0, msg):
                self.relayed += 1
            else:  # rank 0's deadline fails the request; nothing to retry towards
                log.warning("could not relay a notification to rank 0 (%d bytes)", len(msg))
        return len(got)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                got = self.relay_once()
            except Exception as e:  # the agent closed under us (the process is going down)
                log.warning("notification relay stopped: %s", e)
                return
            if not got:
                time.sleep(RELAY_IDLE_S)

    def close(self, timeout: Optional[float] = 1.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self.agent.close()
