"""Where each rank of one engine lives when the engine spans several hosts (`--nnodes`).

Pure, torch-free: the CLI, the engine core, the ranks and a worker node's agent all read it.

One engine is one process group of `--tp-size` ranks (the world). With `--nnodes N` the world is
spread over N hosts ("nodes"), each running `--tp-size / N` ranks on its own GPUs:

    global rank = node_rank * ranks_per_node + local_rank        (local rank = the GPU index)

Node 0 runs global rank 0 (the engine: HTTP, scheduler, PD) and its local ranks 1.. ; every other
node runs its ranks only. Data-parallel attention (`--dp-size`, later) splits the same world into
attention groups; it does not change this layout.

`--dist-init-addr HOST:PORT` names node 0: HOST:PORT is torch.distributed's rendezvous (rank 0
serves it), HOST:PORT+1 the node channel (dsv4_engine.parallel.node_channel) over which node 0
learns, at once and with the reason, that another node or one of its ranks is gone.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
import sys
from dataclasses import dataclass
from typing import Optional

NODE_CHANNEL_OFFSET = 1  # the node channel listens on the rendezvous port + this


def parse_host_port(text: str) -> tuple[str, int]:
    """'HOST:PORT' or '[v6]:PORT' -> (host, port); ValueError with a one-line reason."""
    raw = (text or "").strip()
    if raw.startswith("["):
        host, sep, rest = raw[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise ValueError(f"--dist-init-addr {text!r}: expected [IPv6]:PORT")
        port_text = rest[1:]
    else:
        host, sep, port_text = raw.rpartition(":")
        if not sep or ":" in host:
            raise ValueError(f"--dist-init-addr {text!r}: expected HOST:PORT (IPv6 as [ADDR]:PORT)")
    if not host:
        raise ValueError(f"--dist-init-addr {text!r}: no host")
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"--dist-init-addr {text!r}: the port must be a number") from None
    if not 1 <= port <= 65535 - NODE_CHANNEL_OFFSET:
        raise ValueError(
            f"--dist-init-addr {text!r}: the port must be 1..{65535 - NODE_CHANNEL_OFFSET} "
            f"(port+{NODE_CHANNEL_OFFSET} is the node channel)"
        )
    return host, port


def url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


@dataclass(frozen=True)
class NodeLayout:
    """This node's place in the engine's world."""

    tp_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: Optional[str] = None

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1

    @property
    def ranks_per_node(self) -> int:
        return self.tp_size // self.nnodes

    def global_rank(self, local_rank: int) -> int:
        return self.node_rank * self.ranks_per_node + local_rank

    def local_ranks(self) -> list[int]:
        """Global ranks this node runs, in local-rank order."""
        return [self.global_rank(i) for i in range(self.ranks_per_node)]

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    @property
    def init_host(self) -> str:
        return parse_host_port(self.dist_init_addr or "")[0]

    @property
    def init_port(self) -> int:
        return parse_host_port(self.dist_init_addr or "")[1]

    @property
    def channel_port(self) -> int:
        return self.init_port + NODE_CHANNEL_OFFSET

    def init_method(self) -> str:
        return f"tcp://{url_host(self.init_host)}:{self.init_port}"

    def describe(self) -> str:
        ranks = self.local_ranks()
        span = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"
        return f"node {self.node_rank} of {self.nnodes} ({span} of {self.tp_size})"


def layout_refusal(tp_size: int, nnodes: int, node_rank: int, dist_init_addr: Optional[str]) -> Optional[str]:
    """Why these flags make no layout, in one line, or None. Checked before any rank starts."""
    if nnodes < 1:
        return f"--nnodes must be at least 1, not {nnodes}"
    if not 0 <= node_rank < nnodes:
        return f"--node-rank {node_rank} is not a node of --nnodes {nnodes} (0..{nnodes - 1})"
    if tp_size % nnodes:
        return (
            f"--tp-size {tp_size} does not split over --nnodes {nnodes}: every node runs the same number of "
            f"ranks (--tp-size is the whole engine's, e.g. 16 over 2 nodes of 8 GPUs)"
        )
    if dist_init_addr is not None:
        try:
            parse_host_port(dist_init_addr)
        except ValueError as e:
            return str(e)
    elif nnodes > 1:
        return f"--nnodes {nnodes} needs --dist-init-addr HOST:PORT (node 0's address, the same on every node)"
    return None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def route_address(host: str, port: int) -> Optional[str]:
    """This host's own address on the route to host:port (no packet is sent), or None."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, _, _, _, addr in infos:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(addr)
                return s.getsockname()[0]
        except OSError:
            continue
    return None


def interface_of(address: str) -> Optional[str]:
    """The network interface holding an IPv4 address (Linux), or None."""
    if not sys.platform.startswith("linux") or ":" in address:
        return None
    import fcntl

    siocgifaddr = 0x8915
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
        if socket.inet_ntoa(packed[20:24]) == address:
            return name
    return None


def socket_interface(layout: NodeLayout) -> Optional[str]:
    """The interface gloo (and NCCL's bootstrap) should use: the one on the route to node 0.
    Without it gloo resolves this host's name, which some distributions map to 127.0.1.1 and
    which then cannot reach another host. None when unknown (the libraries' own choice stays)."""
    if not layout.multi_node:
        return "lo"
    host = layout.init_host
    if is_loopback(host):
        return "lo"
    address = route_address(host, layout.init_port)
    return interface_of(address) if address else None


def set_socket_interface(layout: NodeLayout, environ=os.environ) -> Optional[str]:
    """GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME for this node, unless the user set them."""
    if not sys.platform.startswith("linux"):
        return None
    name = socket_interface(layout)
    if name:
        environ.setdefault("GLOO_SOCKET_IFNAME", name)
        if layout.multi_node:
            environ.setdefault("NCCL_SOCKET_IFNAME", name)
    return environ.get("GLOO_SOCKET_IFNAME")
