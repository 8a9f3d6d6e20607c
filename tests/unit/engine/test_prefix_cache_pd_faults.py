"""PD faults on a prefill engine whose prefix cache shares pages between requests: what one
request's injected fault does stays with that request. A failed transfer frees none of the
pages another request holds, and a corrupted transfer does not corrupt the KV that another
request reads from the shared pages (nor what its decode receives)."""

from __future__ import annotations

import torch

from dsv4_engine.engine import Engine
from dsv4_engine.engine_args import EngineArgs
from dsv4_engine.pd.common import PDSettings
from dsv4_engine.pd.request_info import PDRequestInfo
from dsv4_engine.pd.decode import DecodeController
from dsv4_engine.pd.fake import FakeFabric
from dsv4_engine.pd.faults import FaultInjector, FaultyTransport
from dsv4_engine.pd.prefill import PrefillController
from dsv4_engine.pd.transport import PoolStates
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.sequence import Sequence

BOOTSTRAP_ADDR = "http://127.0.0.1:9100"
DECODE_URL = "http://127.0.0.1:8200"
PAGES = 32
SYSTEM = list(range(10, 60))  # 50 tokens: 3 full pages of 16 that every request below shares


class Cluster:
    def __init__(self, model):
        make = lambda role, cache=True: Engine(
            EngineArgs(  # noqa: E731
                model=str(model),
                role=role,
                device="cpu",
                kernel_backend="cpu",
                kv_pages=PAGES,
                page_size=16,
                served_model_name="m",
                enable_prefix_cache=cache,
            )
        )
        self.p, self.d, self.mono = make("prefill"), make("decode"), make("mono", cache=False)
        self.fabric = FakeFabric()
        self.faults = FaultInjector()
        settings = PDSettings(bootstrap_timeout=30, transfer_timeout=30, waiting_timeout=30, url=DECODE_URL)
        pstates = PoolStates.of_pool(self.p.pool)
        self.p.pd = PrefillController(
            self.p,
            settings,
            FaultyTransport(self.fabric.transport("prefill-x", pstates), self.faults, states=pstates),
            self.fabric.channel(self.p.call),
        )
        self.d.pd = DecodeController(
            self.d,
            settings,
            self.fabric.transport("decode-x", PoolStates.of_pool(self.d.pool)),
            self.fabric.channel(self.d.call),
        )
        self.fabric.serve(BOOTSTRAP_ADDR, self.p.pd, "prefill")
        self.fabric.serve(DECODE_URL, self.d.pd, "decode")
        self.room = 0

    def request(self, prompt: list[int], n: int = 5):
        """Submit one request to both sides; returns (prefill seq, decode seq, decode's tokens, ends)."""
        self.room += 1
        tokens: list[int] = []
        ends: dict = {}
        seqs = []
        for side, eng in (("p", self.p), ("d", self.d)):

            def sink(o, side=side):
                if side == "d":
                    tokens.extend(o.token_ids)
                if o.finished:
                    ends[side] = o

            s = Sequence(
                f"{side}{self.room}",
                list(prompt),
                SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                sink=sink,
            )
            s.pd = PDRequestInfo("127.0.0.1", 9100, self.room)
            s.prefill_only = side == "p"
            eng.submit(s)
            seqs.append(s)
        return seqs[0], seqs[1], tokens, ends

    def run(self, done, limit: int = 3000) -> None:
        for _ in range(limit):
            if done():
                return
            for e in (self.p, self.d):
                if e.scheduler.has_work() or not e.inbox.empty() or e.pd.busy():
                    e.step()
                else:
                    e.pd.poll()
        raise AssertionError("no progress")

    def mono_tokens(self, prompt: list[int], n: int = 5) -> list[int]:
        out: list[int] = []
        s = Sequence(
            f"m{len(prompt)}-{n}-{self.room}",
            list(prompt),
            SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
            sink=lambda o: out.extend(o.token_ids),
        )
        self.mono.submit(s)
        while not s.finished:
            self.mono.step()
        return out

    def assert_clean(self) -> None:
        for e in (self.p, self.d):
            assert e.pool.allocator._refs == {} and e.pool.allocator.num_free == PAGES
        self.p.prefix_cache.check()


def test_a_failed_transfer_frees_no_page_another_request_holds(tiny_model):
    c = Cluster(tiny_model)
    sender = c.fabric.transports["prefill-x"]
    sender.stall_next(1)  # a's transfer stays in flight: a holds the shared pages meanwhile
    pa, da, a_tokens, a_ends = c.request(SYSTEM + [7, 8])
    c.run(lambda: pa.pd.room in c.p.pd.inflight)
    shared = list(pa.pages[:3])
    c.faults.arm("fail_transfer", 1)
    pb, db, _, b_ends = c.request(SYSTEM + [9, 9, 9])
    c.run(lambda: "p" in b_ends and "d" in b_ends)
    assert "injected fault" in b_ends["p"].error and b_ends["d"].error
    assert c.p.prefix_cache.hit_tokens == 48  # b did share a's pages
    assert all(c.p.pool.allocator.refcount(p) == 1 for p in shared)  # a's references, untouched
    sender.finish_stalled()
    c.run(lambda: "d" in a_ends)
    assert a_ends["d"].error is None and a_tokens == c.mono_tokens(SYSTEM + [7, 8])
    c.assert_clean()


def test_a_corrupted_transfer_does_not_corrupt_the_shared_pages_others_read(tiny_model):
    """a's transfer is stalled with one byte flipped on the sender; b, sharing the system
    prompt's pages, is prefilled and handed off meanwhile: b's decode must receive exactly the
    pages prefill holds once the byte is back (it used to get the flipped byte of page 0)."""
    c = Cluster(tiny_model)
    sender = c.fabric.transports["prefill-x"]
    sender.stall_next(1)
    c.faults.arm("corrupt_transfer", 1)
    pa, da, _, a_ends = c.request(SYSTEM + [7, 8])
    c.run(lambda: pa.pd.room in c.p.pd.inflight)
    pb, db, b_tokens, b_ends = c.request(SYSTEM + [9, 9, 9], n=3)
    c.run(lambda: db.num_computed > 0)  # b's pages landed on decode
    shared = list(pa.pages[:3])
    assert pb.pages[:3] == shared
    name = next(iter(c.p.pool.states))
    landed = c.d.pool.states[name][db.pages[:3]].clone()
    sender.finish_stalled()
    c.run(lambda: "d" in a_ends and "d" in b_ends)
    assert torch.equal(landed, c.p.pool.states[name][shared])
    assert b_ends["d"].error is None and b_tokens == c.mono_tokens(SYSTEM + [9, 9, 9], n=3)
    c.assert_clean()
