"""A KV-transfer peer in its own process, driven from a test over a multiprocessing Pipe.

The child hosts KVTransferAgents (by name) and keeps polling their notifications, as an
engine loop would, except for agents the test has paused (to hold back connection setup).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from typing import Any

REPLY_TIMEOUT_S = 60.0  # spawning imports torch and NIXL: slow on a busy 2-core machine


def _serve(conn: Any) -> None:
    import torch

    from dsv4_engine.pd.nixl.agent import KVTransferAgent
    from dsv4_engine.pd.transport import TransferState
    from dsv4_engine.pd.transport import PoolStates

    agents: dict[str, KVTransferAgent] = {}
    paused: set[str] = set()
    notifs: dict[str, list[tuple[str, bytes]]] = {}
    while True:
        for name, agent in agents.items():
            if name not in paused:
                notifs[name].extend(agent.poll_notifs())
        if not conn.poll(0.0005):
            continue
        cmd, *args = conn.recv()
        if cmd == "create":
            name, shape, dtype, start_paused, seed = args
            # shape: one region's shape, or {region: (shape, dtype[, "slot"])} for a multi-state pool
            layout = shape if isinstance(shape, dict) else {"kv": (shape, dtype)}
            states, slots = {}, {}
            for i, (region, (rshape, rdtype, *kind)) in enumerate(layout.items()):
                if seed is None:
                    t = torch.zeros(rshape, dtype=getattr(torch, rdtype))
                else:
                    g = torch.Generator().manual_seed(seed + i)
                    t = torch.randn(rshape, generator=g).to(getattr(torch, rdtype))
                (slots if kind == ["slot"] else states)[region] = t
            agent = KVTransferAgent(name, PoolStates(states, slots))
            agents[name], notifs[name] = agent, []
            if start_paused:
                paused.add(name)
            conn.send(agent.descriptor())
        elif cmd == "add_peer":
            conn.send(agents[args[0]].add_peer(args[1]))
        elif cmd == "pages":  # raw bytes of the given pages of one region, for byte-exact comparison
            name, pages, *region = args
            pool = agents[name]._states[region[0] if region else "kv"]
            conn.send(pool[torch.tensor(pages)].contiguous().view(torch.uint8).numpy().tobytes())
        elif cmd == "notifs":
            conn.send(notifs[args[0]])
            notifs[args[0]] = []
        elif cmd == "pause":
            name, on = args
            (paused.add if on else paused.discard)(name)
            conn.send(True)
        elif cmd == "write":  # a whole transfer from this side; returns (state name, error)
            name, peer, src, dst, notif = args
            agent = agents[name]
            h = agent.write_pages(peer, src, dst, notif)
            deadline = time.monotonic() + 15
            while agent.poll(h) is TransferState.PENDING and time.monotonic() < deadline:
                notifs[name].extend(agent.poll_notifs())
            conn.send((agent.poll(h).name, agent.error(h)))
            agent.release(h)
        elif cmd == "send_notif":
            conn.send(agents[args[0]].send_notif(args[1], args[2]))
        elif cmd == "exit":
            for agent in agents.values():
                agent.close()
            conn.send(True)
            return


def _context() -> Any:
    """A forkserver that has imported torch and NIXL once: each peer is a fresh process forked
    from it (no agent exists before the fork), without paying those imports every time."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "nixl_cu12", "dsv4_engine.pd.nixl.agent", __name__])
    return ctx


class PeerProcess:
    def __init__(self) -> None:
        ctx = _context()
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child,), daemon=True)
        self.proc.start()
        child.close()

    def call(self, *cmd: Any, timeout: float = REPLY_TIMEOUT_S) -> Any:
        self.send(*cmd)
        return self.reply(timeout, cmd[0])

    def send(self, *cmd: Any) -> None:
        """Start a command without waiting (while this side must keep polling its own agent)."""
        self._conn.send(cmd)

    def replied(self) -> bool:
        return self._conn.poll()

    def reply(self, timeout: float = REPLY_TIMEOUT_S, what: str = "command") -> Any:
        if not self._conn.poll(timeout):
            raise TimeoutError(f"peer process did not answer {what!r} within {timeout} s")
        return self._conn.recv()

    def create(
        self, name: str, shape: tuple, dtype: str = "float32", paused: bool = False, seed: int | None = None
    ) -> dict:
        """A KVTransferAgent in the child over a pool of zeros (or seeded random values)."""
        return self.call("create", name, shape, dtype, paused, seed)

    def wait_notifs(self, name: str, expected: int, timeout: float = 20.0) -> list[tuple[str, bytes]]:
        """Collect notifications for agent `name` until `expected` have arrived (or time out)."""
        got: list[tuple[str, bytes]] = []
        deadline = time.monotonic() + timeout
        while len(got) < expected and time.monotonic() < deadline:
            got.extend(self.call("notifs", name))
        return got

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("exit", timeout=10)
            except (TimeoutError, EOFError, BrokenPipeError, OSError):
                pass
            self.proc.join(5)
            if self.proc.is_alive():
                self.kill()
