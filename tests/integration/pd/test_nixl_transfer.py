"""KVTransferAgent between real processes over real NIXL (UCX on host memory).

The test process is the writing (prefill) side; a spawned child hosts the receiving (decode)
side and polls its notifications like an engine loop. Waiting is always a poll with a deadline.
"""

from __future__ import annotations

import time

import pytest
import torch

from dsv4_engine.pd.nixl.agent import KVTransferAgent
from dsv4_engine.pd.transport import TransferState
from dsv4_engine.pd.transport import KVTransport, PoolStates
from nixl_peer import PeerProcess

SHAPE = (32, 2, 16, 64)  # 32 pages of [layers=2, page_size=16, kv_dim=64]: 8 KiB fp32, 4 KiB bf16
DEADLINE_S = 15.0


def wait_terminal(agent: KVTransferAgent, handle: int, timeout: float = DEADLINE_S) -> TransferState:
    deadline = time.monotonic() + timeout
    state = agent.poll(handle)
    while state is TransferState.PENDING and time.monotonic() < deadline:
        state = agent.poll(handle)
    return state


def page_bytes(pool: torch.Tensor, pages: list[int]) -> bytes:
    return pool[torch.tensor(pages)].contiguous().view(torch.uint8).numpy().tobytes()


def filled_pool(dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=g).to(dtype)


@pytest.fixture(scope="module")
def peer():
    p = PeerProcess()
    yield p
    p.stop()


@pytest.fixture(scope="module")
def writer():
    agent = KVTransferAgent("writer", filled_pool(torch.float32, 1))
    yield agent
    agent.close()


@pytest.fixture(scope="module")
def target(peer, writer):
    """A receiving agent in the peer process, loaded into the writer."""
    desc = peer.create("target", SHAPE, "float32")
    assert writer.add_peer(desc) == "target"
    return desc


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_paged_write_random_mapping_is_byte_exact(peer, dtype):
    name = f"dst-{dtype}"
    with KVTransferAgent(f"src-{dtype}", filled_pool(getattr(torch, dtype), 7)) as src:
        src.add_peer(peer.create(name, SHAPE, dtype))
        g = torch.Generator().manual_seed(3)
        src_pages = torch.randperm(SHAPE[0], generator=g)[:20].tolist()
        dst_pages = torch.randperm(SHAPE[0], generator=g)[:20].tolist()
        h = src.write_pages(name, src_pages, dst_pages, b"kv-ready")
        assert wait_terminal(src, h) is TransferState.DONE, src.error(h)
        info = src.info(h)
        assert info.nbytes == 20 * src.page_nbytes and info.error is None
        src.release(h)
        assert peer.wait_notifs(name, 1) == [(src.name, b"kv-ready")]
        assert peer.call("pages", name, dst_pages) == page_bytes(src._states["kv"], src_pages)
        untouched = sorted(set(range(SHAPE[0])) - set(dst_pages))
        assert peer.call("pages", name, untouched) == bytes(len(untouched) * src.page_nbytes)


def test_every_state_region_moves_with_one_notification(peer):
    """A pool of several states (what DeepSeek-V4 declares): each page moves in every region."""
    layout = {
        "latent": ((16, 2, 16, 64), "float32"),
        "ring": ((16, 3, 8, 32), "bfloat16"),
        "index": ((16, 2, 4, 16), "float32"),
    }
    g = torch.Generator().manual_seed(9)
    states = {name: torch.randn(shape, generator=g).to(getattr(torch, dt)) for name, (shape, dt) in layout.items()}
    with KVTransferAgent("multi-src", states) as src:
        assert isinstance(src, KVTransport)  # the production transport keeps the declared seam
        src.add_peer(peer.create("multi-dst", layout))
        h = src.write_pages("multi-dst", [1, 7, 3], [4, 0, 15], b"all-regions")
        assert wait_terminal(src, h) is TransferState.DONE, src.error(h)
        assert src.info(h).nbytes == 3 * sum(t[0].numel() * t.element_size() for t in states.values())
        src.release(h)
        assert peer.wait_notifs("multi-dst", 1) == [("multi-src", b"all-regions")]
        for name in layout:
            assert peer.call("pages", "multi-dst", [4, 0, 15], name) == page_bytes(states[name], [1, 7, 3]), name
            assert peer.call("pages", "multi-dst", [2], name) == bytes(
                states[name][0].numel() * states[name].element_size()
            )
        # A peer that lacks a region, or has it in another shape, is refused at add_peer.
        for i, other in enumerate(
            ({"latent": layout["latent"], "ring": layout["ring"]}, {**layout, "ring": ((16, 3, 16, 32), "bfloat16")})
        ):
            with pytest.raises(ValueError, match="incompatible KV layout"):
                src.add_peer(peer.create(f"multi-bad{i}", other))


def test_slot_rows_move_with_the_pages_under_one_notification(peer):
    """DeepSeek-V4's pool: paged regions plus slot regions (one row per running request). One
    transfer writes the pages of every paged region and one row of every slot region."""
    layout = {
        "csa_kv": ((16, 2, 4, 64), "float32"),
        "swa_kv": ((4, 3, 8, 64), "float32", "slot"),
        "hca_stage": ((4, 1, 8, 32), "bfloat16", "slot"),
    }
    g = torch.Generator().manual_seed(11)
    pages = {"csa_kv": torch.randn(16, 2, 4, 64, generator=g)}
    slots = {
        "swa_kv": torch.randn(6, 3, 8, 64, generator=g),  # more rows here than the peer has
        "hca_stage": torch.randn(6, 1, 8, 32, generator=g).bfloat16(),
    }
    with KVTransferAgent("slot-src", PoolStates(pages, slots)) as src:
        src.add_peer(peer.create("slot-dst", layout))
        h = src.write_pages("slot-dst", [5, 2], [0, 9], b"pages+row", src_slot=5, dst_slot=3)
        assert wait_terminal(src, h) is TransferState.DONE, src.error(h)
        info = src.info(h)
        assert info.nbytes_by_state == {"csa_kv": 2 * 2048, "swa_kv": 3 * 8 * 64 * 4, "hca_stage": 8 * 32 * 2}
        src.release(h)
        assert peer.wait_notifs("slot-dst", 1) == [("slot-src", b"pages+row")]
        assert peer.call("pages", "slot-dst", [0, 9], "csa_kv") == page_bytes(pages["csa_kv"], [5, 2])
        for name, t in slots.items():
            assert peer.call("pages", "slot-dst", [3], name) == page_bytes(t, [5]), name
            assert peer.call("pages", "slot-dst", [0, 1, 2], name) == bytes(3 * t[0].numel() * t.element_size())
        with pytest.raises(ValueError, match="dst_slot 4 is outside"):
            src.write_pages("slot-dst", [0], [0], b"", src_slot=0, dst_slot=4)
        with pytest.raises(ValueError, match="src_slot must be a slot row"):
            src.write_pages("slot-dst", [0], [0], b"")
        # a peer whose slot state has another row shape is refused before anything moves
        bad = {**layout, "swa_kv": ((4, 3, 16, 64), "float32", "slot")}
        with pytest.raises(ValueError, match="slot region swa_kv: slot shape"):
            src.add_peer(peer.create("slot-bad", bad))


def test_hundred_sequential_transfers_notify_exactly_once(peer, writer, target):
    expected = []
    for i in range(100):
        page = i % SHAPE[0]
        h = writer.write_pages("target", [page], [(page * 7 + 3) % SHAPE[0]], b"t%03d" % i)
        assert wait_terminal(writer, h) is TransferState.DONE, writer.error(h)
        writer.release(h)
        expected.append(("writer", b"t%03d" % i))
    got = peer.wait_notifs("target", 100)
    mapping = {(p * 7 + 3) % SHAPE[0]: p for p in range(SHAPE[0])}  # dst page -> src page
    # A marker sent after everything else: once it arrives, a duplicate would have too.
    h = writer.write_pages("target", [mapping[0]], [0], b"marker")
    assert wait_terminal(writer, h) is TransferState.DONE
    writer.release(h)
    got += peer.wait_notifs("target", 1)
    assert got == expected + [("writer", b"marker")]
    dst = sorted(mapping)
    assert peer.call("pages", "target", dst) == page_bytes(writer._states["kv"], [mapping[d] for d in dst])


def test_bad_pages_raise_before_anything_starts(peer, writer, target):
    before = peer.call("pages", "target", [5])
    for src, dst in ([[0], [SHAPE[0]]], [[-1], [5]], [[0, 1], [5]], [[0, 1], [5, 5]], [[], []], [[0.5], [5]]):
        with pytest.raises(ValueError):
            writer.write_pages("target", src, dst, b"bad")
    with pytest.raises(ValueError):
        writer.write_pages("nobody", [0], [5], b"bad")
    h = writer.write_pages("target", [1], [6], b"after-bad")
    assert wait_terminal(writer, h) is TransferState.DONE
    writer.release(h)
    assert peer.wait_notifs("target", 1) == [("writer", b"after-bad")]
    assert peer.call("pages", "target", [5]) == before


def test_incompatible_layout_is_refused(peer, writer):
    desc = peer.create("other-layout", SHAPE, "bfloat16")
    with pytest.raises(ValueError, match="incompatible KV layout"):
        writer.add_peer(desc)
    assert "other-layout" not in writer.peers()


def test_add_peer_is_idempotent_and_notifs_flow_back(peer, writer, target):
    assert writer.add_peer(target) == "target"
    assert writer.peers().count("target") == 1
    # The receiving side loads the writer too and answers with a standalone message.
    assert peer.call("add_peer", "target", writer.descriptor()) == "writer"
    assert peer.call("send_notif", "target", "writer", b"abort:room-7") is True
    got = []
    deadline = time.monotonic() + DEADLINE_S
    while not got and time.monotonic() < deadline:
        got = writer.poll_notifs()
    assert got == [("target", b"abort:room-7")]


def test_stalled_transfer_times_out_then_peer_recovers(peer, writer):
    # The peer does not poll, so the connection cannot be set up: the transfer stays pending.
    writer.add_peer(peer.create("stalled", SHAPE, "float32", paused=True))
    t0 = time.monotonic()
    h = writer.write_pages("stalled", [2], [3], b"never", timeout_s=0.3)
    state = wait_terminal(writer, h)
    assert state is TransferState.FAILED
    assert time.monotonic() - t0 >= 0.3
    assert "timed out" in writer.error(h)
    writer.release(h)
    peer.call("pause", "stalled", False)
    h = writer.write_pages("stalled", [2], [3], b"now")
    assert wait_terminal(writer, h) is TransferState.DONE, writer.error(h)
    writer.release(h)
    assert ("writer", b"now") in peer.wait_notifs("stalled", 1)
    assert peer.call("pages", "stalled", [3]) == page_bytes(writer._states["kv"], [2])


def test_killed_peer_fails_transfers_and_restarted_peer_reconnects():
    pool = filled_pool(torch.float32, 11)
    with KVTransferAgent("prefill", pool) as agent:
        victim = PeerProcess()
        try:
            # Paused: the connection is not set up, so the transfer is surely still in flight.
            agent.add_peer(victim.create("decode", SHAPE, "float32", paused=True))
            h = agent.write_pages("decode", [0, 1, 2], [3, 4, 5], b"lost")
            assert agent.poll(h) is TransferState.PENDING
            victim.kill()
            t0 = time.monotonic()
            assert wait_terminal(agent, h, timeout=10.0) is TransferState.FAILED
            assert time.monotonic() - t0 < 10.0
            assert agent.error(h)
            agent.release(h)
            # Writing to the dead peer neither raises nor hangs.
            h = agent.write_pages("decode", [0], [0], b"still-dead")
            assert wait_terminal(agent, h, timeout=10.0) is TransferState.FAILED
            agent.release(h)
        finally:
            victim.stop()

        reborn = PeerProcess()
        try:
            assert agent.add_peer(reborn.create("decode", SHAPE, "float32")) == "decode"
            for i in range(3):
                h = agent.write_pages("decode", [i, i + 8], [i + 16, i + 24], b"back%d" % i)
                assert wait_terminal(agent, h) is TransferState.DONE, agent.error(h)
                agent.release(h)
            assert reborn.wait_notifs("decode", 3) == [("prefill", b"back%d" % i) for i in range(3)]
            assert reborn.call("pages", "decode", [16, 24, 18, 26]) == page_bytes(pool, [0, 8, 2, 10])

            # Killed while transfers stream over an established connection: every handle still
            # ends (DONE before the kill, FAILED after), and none raises.
            states = []
            reborn.proc.kill()
            deadline = time.monotonic() + 10.0
            while TransferState.FAILED not in states and time.monotonic() < deadline:
                h = agent.write_pages("decode", [1], [1], b"stream")
                states.append(wait_terminal(agent, h, timeout=10.0))
                agent.release(h)
            assert states[-1] is TransferState.FAILED
        finally:
            reborn.stop()


def test_receiver_keeps_working_when_the_writer_restarts():
    """The decode side (here) loaded the prefill side for abort messages; prefill restarts."""
    with KVTransferAgent("decode-r", torch.zeros(SHAPE)) as decode:

        def wait_notif(timeout: float = DEADLINE_S) -> list[tuple[str, bytes]]:
            got, deadline = [], time.monotonic() + timeout
            while not got and time.monotonic() < deadline:
                got = decode.poll_notifs()
            return got

        for incarnation in (1, 2):
            prefill = PeerProcess()
            try:
                desc = prefill.create("prefill-r", SHAPE, "float32", seed=incarnation)
                assert decode.add_peer(desc) == "prefill-r"  # reconnects on the second round
                assert prefill.call("add_peer", "prefill-r", decode.descriptor()) == "decode-r"
                # Connection setup needs the receiver's progress: keep polling, as an engine
                # loop does, while the child runs its transfer.
                prefill.send("write", "prefill-r", "decode-r", [0, 1], [4, 9], b"kv%d" % incarnation)
                got, deadline = [], time.monotonic() + DEADLINE_S
                while not prefill.replied() and time.monotonic() < deadline:
                    got += decode.poll_notifs()
                state, error = prefill.reply()
                assert state == "DONE", error
                if not got:
                    got = wait_notif()
                assert got == [("prefill-r", b"kv%d" % incarnation)]
                expect = torch.randn(SHAPE, generator=torch.Generator().manual_seed(incarnation))[[0, 1]]
                assert torch.equal(decode._states["kv"][[4, 9]], expect)
                assert decode.send_notif("prefill-r", b"abort:%d" % incarnation) is True
                assert prefill.wait_notifs("prefill-r", 1) == [("decode-r", b"abort:%d" % incarnation)]
            finally:
                prefill.kill() if incarnation == 1 else prefill.stop()


def test_a_write_waits_for_its_pages_ready_event_not_the_whole_stream(peer, monkeypatch):
    """Prefill hands every write of a request the event recorded after the kernels that wrote its
    pages (transport.pages_ready): each write waits for that, never for the whole stream."""

    class Ready:  # what a torch.cuda.Event offers the agent
        waits = 0

        def synchronize(self) -> None:
            self.waits += 1

    def whole_stream(*_a, **_k):
        raise AssertionError("a write synchronised the whole stream")

    monkeypatch.setattr(torch.cuda, "current_stream", whole_stream)
    ready = Ready()
    with KVTransferAgent("ready-src", filled_pool(torch.float32, 5)) as src:
        src.add_peer(peer.create("ready-dst", SHAPE, "float32"))
        for page in range(3):  # as prefill's writes into three decode ranks
            h = src.write_pages("ready-dst", [page], [page], b"", ready=ready)
            assert wait_terminal(src, h) is TransferState.DONE, src.error(h)
        assert ready.waits == 3 and src.device_waits == 3
        h = src.write_pages("ready-dst", [3], [3], b"")  # host memory, no event: nothing to wait for
        assert wait_terminal(src, h) is TransferState.DONE and src.device_waits == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: bench/gpu_kernels.sh runs it")
def test_a_write_from_vram_waits_for_the_kernel_that_wrote_its_page():
    """On CUDA (VRAM -> VRAM, two agents in this process): a page whose writing kernel is still
    queued behind busy work when the write starts arrives whole, since the write waits for the
    event `pages_ready` recorded after that kernel, and for nothing else."""
    from dsv4_engine.pd.transport import pages_ready

    src_pool, dst_pool = torch.zeros(SHAPE, device="cuda"), torch.zeros(SHAPE, device="cuda")
    with KVTransferAgent("vram-src", src_pool) as src, KVTransferAgent("vram-dst", dst_pool) as dst:
        src.add_peer(dst.descriptor())
        busy = torch.randn(2048, 2048, device="cuda")
        for _ in range(30):  # keeps the stream busy well past the write's start
            busy = busy @ busy / 2048
        src_pool[1].fill_(7.0)  # queued after the busy work
        h = src.write_pages("vram-dst", [1], [1], b"landed", ready=pages_ready(src_pool))
        deadline = time.monotonic() + DEADLINE_S
        while src.poll(h) is TransferState.PENDING and time.monotonic() < deadline:
            dst.poll_notifs()
        assert src.poll(h) is TransferState.DONE, src.error(h)
        assert src.device_waits == 1 and bool((dst_pool[1] == 7.0).all())
