"""`dsv4 up --nnodes N`: each engine a group of N local "node" processes, the way a cluster runs a
multi-node engine (dsv4_operator.groups). Node 0 is the engine the router knows (its HTTP API on
the engine's port); nodes 1..N-1 are `dsv4 serve --node-rank R` processes (ranks only, and their
node agent's HTTP surface on a port of their own), all meeting at a rendezvous on 127.0.0.1.

The supervisor restarts any of them that dies, as a kubelet restarts a container (a lost node
fails its group at once: node 0 exits, and is restarted; the other nodes rejoin it); the
watchdog judges each group as one engine (watchdog.groups) and restarts all its processes at once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from dsv4_operator.local.supervisor import EngineProc
from dsv4_wire import EngineFlags as F

NODE_PORT_OFFSET = 200  # node agents' HTTP ports: --port + 200 ..
RENDEZVOUS_OFFSET = 300  # rendezvous ports (each uses two: +1 is the node channel): --port + 300 ..


def group_flags(nnodes: int, node_rank: int, rendezvous_port: int) -> list[str]:
    return [F.NNODES, str(nnodes), F.NODE_RANK, str(node_rank), F.DIST_INIT_ADDR, f"127.0.0.1:{rendezvous_port}"]


def node_cmd(
    leader_base: list[str], extra_args: list[str], nnodes: int, rank: int, port: int, rendezvous: int
) -> list[str]:
    """Node `rank`'s command: node 0's, on its own port, with its own node rank (last flags win)."""
    return [*_without_port(leader_base), F.PORT, str(port), *extra_args, *group_flags(nnodes, rank, rendezvous)]


def make_groups(
    engines: Mapping[str, EngineProc],
    base_cmds: dict[str, list[str]],
    extra_args: list[str],
    nnodes: int,
    base_port: int,
    state_dir: Path,
    env: Mapping[str, str],
) -> dict[str, list[EngineProc]]:
    """Turn each engine into node 0 of a group and make its other nodes' processes (returned by
    engine key). `base_cmds` (each engine's command without the extra args) gets node 0's flags."""
    groups: dict[str, list[EngineProc]] = {}
    if nnodes <= 1:
        return groups
    for i, (key, eng) in enumerate(engines.items()):
        rendezvous = base_port + RENDEZVOUS_OFFSET + 2 * i
        base_cmds[key] = [*base_cmds[key], *group_flags(nnodes, 0, rendezvous)]
        eng.cmd = [*base_cmds[key], *extra_args]
        nodes = []
        for rank in range(1, nnodes):
            port = base_port + NODE_PORT_OFFSET + i * (nnodes - 1) + rank - 1
            cmd = node_cmd(base_cmds[key], extra_args, nnodes, rank, port, rendezvous)
            node = EngineProc(f"{key}/node{rank}", eng.role, port, cmd, state_dir / f"{key}.node{rank}.log", env=env)
            node.rendezvous, node.rank = rendezvous, rank  # type: ignore[attr-defined]
            nodes.append(node)
        groups[key] = nodes
    return groups


def rebuild(nodes: list[EngineProc], leader_base: list[str], extra_args: list[str], nnodes: int) -> None:
    """New extra engine args (a reconfigure): every node of the group takes them."""
    for node in nodes:
        node.cmd = node_cmd(leader_base, extra_args, nnodes, node.rank, node.port, node.rendezvous)  # type: ignore[attr-defined]


def _without_port(cmd: list[str]) -> list[str]:
    """A command without its --port value (a node's agent listens on its own port)."""
    out, skip = [], False
    for arg in cmd:
        if skip:
            skip = False
            continue
        if arg == F.PORT:
            skip = True
            continue
        out.append(arg)
    return out
