"""A multi-node engine's layout (which global ranks a node runs, the flags that make no layout)
and its node channel (who may join, how a lost node is told apart from an orderly stop), with
real sockets on 127.0.0.1 and no torch."""

from __future__ import annotations

import threading
import time

import pytest

from dsv4_engine.parallel.layout import NodeLayout, interface_of, layout_refusal, parse_host_port, socket_interface
from dsv4_engine.parallel.node_channel import NodeClient, NodeServer, answer, hello_refusal
from dsv4_engine.parallel.ranks import node_timeout_s

from bench.harness.commands import free_port_block


def test_ranks_are_laid_out_node_by_node():
    node = NodeLayout(tp_size=16, nnodes=2, node_rank=1, dist_init_addr="leader-0.svc:5000")
    assert node.ranks_per_node == 8 and node.local_ranks() == list(range(8, 16))
    assert node.global_rank(3) == 11 and node.node_of(11) == 1 and node.node_of(7) == 0
    assert node.init_method() == "tcp://leader-0.svc:5000" and node.channel_port == 5001
    assert node.describe() == "node 1 of 2 (ranks 8-15 of 16)"
    assert NodeLayout(2, 2, 0, "[fd00::1]:29500").init_method() == "tcp://[fd00::1]:29500"


@pytest.mark.parametrize(
    "args,words",
    [
        ((3, 2, 0, "h:1"), "--tp-size 3 does not split over --nnodes 2"),
        ((2, 2, 0, None), "--nnodes 2 needs --dist-init-addr HOST:PORT"),
        ((2, 2, 2, "h:1"), "--node-rank 2 is not a node of --nnodes 2"),
        ((2, 2, 1, "h"), "expected HOST:PORT"),
        ((2, 2, 1, "h:port"), "the port must be a number"),
        ((2, 2, 1, "h:65535"), "port+1 is the node channel"),
        ((2, 2, 1, "fd00::1:80"), "IPv6 as [ADDR]:PORT"),
        ((2, 0, 0, "h:1"), "--nnodes must be at least 1"),
    ],
)
def test_flags_that_make_no_layout_are_refused_in_one_line(args, words):
    assert words in layout_refusal(*args)


def test_a_good_layout_passes_and_one_node_needs_no_address():
    assert layout_refusal(16, 2, 1, "leader:5000") is None and layout_refusal(4, 1, 0, None) is None
    assert parse_host_port("[::1]:80") == ("::1", 80)


def test_gloo_uses_the_interface_on_the_route_to_node_0():
    assert socket_interface(NodeLayout(2, 2, 1, "127.0.0.1:5000")) == "lo"
    assert socket_interface(NodeLayout(2)) == "lo"  # one host: loopback, as before
    assert interface_of("127.0.0.1") == "lo"


def expect(nnodes=2, tp=2, model="abc"):
    return {"nnodes": nnodes, "tp_size": tp, "model": model}


def test_node_0_refuses_a_node_that_does_not_fit():
    ok = {"node": 1, "nnodes": 2, "tp_size": 2, "model": "abc"}
    assert hello_refusal(ok, expect(), None, "c", set()) is None
    assert "joined already" in hello_refusal(ok, expect(), None, "c", {1})
    assert "node rank 0 is not a worker node" in hello_refusal({**ok, "node": 0}, expect(), None, "c", set())
    assert "node 1 runs --nnodes 3, node 0 runs --nnodes 2" in hello_refusal(
        {**ok, "nnodes": 3}, expect(), None, "c", set()
    )
    assert "checkpoint differs" in hello_refusal({**ok, "model": "xyz"}, expect(), None, "c", set())
    assert "does not know the group's secret" in hello_refusal(ok, expect(), "s3cret", "c", set())
    assert hello_refusal({**ok, "proof": answer("s3cret", "c")}, expect(), "s3cret", "c", set()) is None
    assert "does not know" in hello_refusal({**ok, "proof": answer("other", "c")}, expect(), "s3cret", "c", set())


def wait_for(check, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_a_node_lost_is_named_at_once_and_an_orderly_stop_is_no_loss():
    port = free_port_block((0,))
    server = NodeServer(port, expect(3), timeout_s=5.0, secret="s3cret")
    lost: list[str] = []
    hello = {"node": 1, "nnodes": 3, "tp_size": 2, "model": "abc", "host": "node-a"}
    try:
        assert server.missing() == [1, 2]
        a = NodeClient("127.0.0.1", port, hello, 5.0, 5.0, lost.append, secret="s3cret")
        b = NodeClient("127.0.0.1", port, {**hello, "node": 2, "host": "node-b"}, 5.0, 5.0, lost.append, "s3cret")
        wait_for(lambda: server.missing() == [])
        with pytest.raises(ConnectionError, match="refused this node: node 1 joined already"):
            NodeClient("127.0.0.1", port, hello, 5.0, 1.0, lost.append, secret="s3cret")
        server.announce_ready()
        wait_for(lambda: a.ready and b.ready)
        b.report_failure("rank 1 (pid 7) exited with code -9")
        wait_for(lambda: server.failure() is not None)
        assert server.failure() == "node 2 (node-b): rank 1 (pid 7) exited with code -9"
        server.announce_failure(server.failure())
        wait_for(lambda: len(lost) == 2)
        assert all(r.startswith("node 0 failed the group: node 2 (node-b)") for r in lost)
        a.close()
        b.close()
    finally:
        server.close()

    port = free_port_block((0,))
    server = NodeServer(port, expect(2), timeout_s=5.0)
    try:
        c = NodeClient("127.0.0.1", port, hello | {"nnodes": 2}, 5.0, 5.0, lost.append)
        c.line.close()  # the node's process killed: its connection closes
        wait_for(lambda: server.failure() is not None)
        assert server.failure() == "node 1 (node-a) is gone: its node channel closed"
    finally:
        server.close()

    port = free_port_block((0,))
    server = NodeServer(port, expect(2), timeout_s=5.0)
    stopped: list[str] = []
    try:
        d = NodeClient("127.0.0.1", port, hello | {"nnodes": 2}, 5.0, 5.0, stopped.append)
        server.announce_stop()
        wait_for(lambda: d.stopping)
        server.close()
        wait_for(lambda: stopped == ["node 0 stopped the engine"])
    finally:
        server.close()


def test_a_silent_node_is_lost_after_the_node_timeout():
    port = free_port_block((0,))
    server = NodeServer(port, expect(2), timeout_s=0.5)
    try:
        c = NodeClient(
            "127.0.0.1", port, {"node": 1, "nnodes": 2, "tp_size": 2, "model": "abc", "host": "h"}, 5, 5, print
        )
        wait_for(lambda: server.missing() == [])
        c._lost = True  # its beats stop, the connection stays open: a frozen host
        wait_for(lambda: server.failure() is not None, timeout=5)
        assert "node 1 (h) gave no sign of life on the node channel for more than 0.5 s" in server.failure()
        c.line.close()
    finally:
        server.close()


def test_node_0_that_never_answers_is_a_join_failure_not_a_hang():
    port = free_port_block((0,))
    started = time.monotonic()
    with pytest.raises(ConnectionError, match="did not answer within 0.5 s"):
        NodeClient("127.0.0.1", port, {"node": 1}, 5, 0.5, print)
    assert time.monotonic() - started < 3


def test_the_node_timeout_from_the_environment_is_checked():
    assert node_timeout_s({}) == 30 and node_timeout_s({"DSV4_NODE_TIMEOUT_S": "2"}) == 2
    with pytest.raises(ValueError, match="DSV4_NODE_TIMEOUT_S must be a number of seconds > 0"):
        node_timeout_s({"DSV4_NODE_TIMEOUT_S": "0"})


def test_threads_are_daemons():
    """The channel must never hold a dying engine's exit up."""
    port = free_port_block((0,))
    server = NodeServer(port, expect(2), timeout_s=5.0)
    try:
        assert all(t.daemon for t in threading.enumerate() if t.name.startswith("dsv4-node"))
    finally:
        server.close()
