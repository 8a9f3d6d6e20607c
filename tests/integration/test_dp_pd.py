"""PD and migration with data-parallel attention (`--tp-size 2 --dp-size 2`) on either side,
behind the real router over real NIXL between real processes (DeepSeek-V3, tiny preset, gloo):
greedy tokens equal a monolithic tp-1 engine's for a single prefill into a DP decode, a DP prefill
into a single decode, DP into DP, and DP to and from a TP (`--tp-size 2`) peer. A DP decode places
each request on a rank by load and the KV lands in that rank's pool alone (`/v1/loads`: per-rank
bytes, both ranks used); a DP prefill's rank that computed a request writes it (pd.dp_sender). A
request migrated into a DP engine (the router's continuation: the answer so far as
`continuation_token_ids`) goes on as the undisturbed request, and one migrated out of it onto a
tp-1 engine too."""

from __future__ import annotations

import random
import threading
import time

import httpx
import pytest

from bench.harness.commands import Proc, free_port, stop_all

pytestmark = pytest.mark.slow

SECRET = "dp-pd-secret"
AUTH = {"Authorization": f"Bearer {SECRET}"}
DP = ["--tp-size", 2, "--dp-size", 2]
# router -> (its prefill, its decode): 1 a tp-1 engine, dp --tp-size 2 --dp-size 2, tp --tp-size 2
SHAPES = {
    "1->dp": ("p1", "d_dp"),
    "dp->1": ("p_dp", "d1"),
    "dp->dp": ("p_dp", "d_dp"),
    "tp->dp": ("p_tp", "d_dp"),
    "dp->tp": ("p_dp", "d_tp"),
}


def loads(url: str) -> dict:
    return httpx.get(f"{url}/v1/loads", timeout=5).json()


def bytes_by_rank(url: str) -> dict[str, int]:
    return dict(loads(url).get("kv_transfer_bytes_by_rank", {}))


def complete(url: str, prompt: list[int], max_tokens: int, headers=None, **extra) -> list[int]:
    r = httpx.post(
        f"{url}/v1/completions",
        json={
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            **extra,
        },
        headers=headers,
        timeout=240,
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def wait_idle(*urls: str, timeout: float = 20.0) -> None:
    """Every page back (on every rank's pool), every queue empty."""
    deadline = time.monotonic() + timeout
    for url in urls:
        while True:
            ld = loads(url)
            if sum(ld["queues"].values()) == 0 and ld["kv_pages_free"] == ld["kv_pages_total"]:
                break
            assert time.monotonic() < deadline, f"{url} still holds pages: {ld}"
            time.sleep(0.05)


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dp-pd")
    common = ["serve", "--model", tiny_model, "--kv-pages", 64, "--page-size", 16, "--served-model-name", "m"]
    common += ["--device", "cpu"]
    procs: list[Proc] = []
    urls: dict[str, str] = {}

    def engine(name: str, *args) -> None:
        port = free_port()
        urls[name] = f"http://127.0.0.1:{port}"
        procs.append(Proc([*common, *args, "--port", port], tmp / f"{name}.log", env={"DSV4_PD_SECRET": SECRET}))

    engine("mono")
    engine("mono_dp", *DP)
    for name, dp in (("p1", []), ("p_dp", DP), ("p_tp", ["--tp-size", 2])):
        # a stalled transfer holds its rank's pages until a 4 s deadline (placement test below)
        faults = ["--enable-fault-injection", "--transfer-timeout", 4] if dp else []
        engine(name, "--role", "prefill", "--bootstrap-port", free_port(), *faults, *dp)
    engine("d1", "--role", "decode")
    engine("d_dp", "--role", "decode", *DP)
    engine("d_tp", "--role", "decode", "--tp-size", 2)
    routers = SHAPES
    try:
        for name, proc in zip(list(urls), procs):
            proc.wait_ready(urls[name], timeout=300)
        for shape, (p, d) in routers.items():
            port = free_port()
            args = ["router", "--prefill", urls[p], "--decode", urls[d], "--port", port, "--health-interval", "0.5"]
            procs.append(Proc(args, tmp / f"router-{shape.replace('>', '')}.log", env={"DSV4_PD_SECRET": SECRET}))
            urls[shape] = f"http://127.0.0.1:{port}"
            procs[-1].wait_ready(urls[shape], timeout=60)
        yield urls
    finally:
        stop_all(procs)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_pd_with_data_parallel_attention_on_either_side_equals_mono(cluster, shape):
    prefill, decode = SHAPES[shape]
    before = (
        bytes_by_rank(cluster[prefill]),
        bytes_by_rank(cluster[decode]),
        dict(loads(cluster[prefill]).get("kv_transfer_bytes_by_prefill_rank", {})),
    )
    rng = random.Random(11)
    prompts = [[rng.randrange(2, 500) for _ in range(rng.randint(3, 40))] for _ in range(4)]
    prompts[0] = [rng.randrange(2, 500) for _ in range(300)]
    results: dict[int, list[int]] = {}

    def one(i):
        time.sleep(0.05 * i)  # staggered: later requests join a running decode batch, on either rank
        results[i] = complete(cluster[shape], prompts[i], 12 + i)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    if prefill == "p_dp":
        # A prefill's pages are held only until they are sent: to see both of its ranks read, the
        # first request's transfer stalls, holding its 19 pages on rank 0 until the 4 s deadline
        # (then it fails on both sides and the router sends it again); the rest are placed on rank 1.
        timeouts = loads(cluster[prefill])["counters"]["num_transfer_timeout_reqs"]
        r = httpx.post(f"{cluster[prefill]}/admin/faults", json={"fault": "stall_transfer", "count": 1}, timeout=5)
        assert r.status_code == 200, r.text
    threads[0].start()
    if prefill == "p_dp":
        deadline = time.monotonic() + 60
        while not loads(cluster[prefill])["queues"]["inflight"]:
            assert time.monotonic() < deadline and threads[0].is_alive(), "the first request never reached transfer"
            time.sleep(0.005)
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join(300)
    for i, p in enumerate(prompts):
        assert results[i] == complete(cluster["mono"], p, 12 + i), (shape, i)
    sent = {r: n - before[0].get(r, 0) for r, n in bytes_by_rank(cluster[prefill]).items()}
    landed = {r: n - before[1].get(r, 0) for r, n in bytes_by_rank(cluster[decode]).items()}
    sent, landed = {r: n for r, n in sent.items() if n}, {r: n for r, n in landed.items() if n}
    assert sum(sent.values()) == sum(landed.values()) > 0, (sent, landed)  # each request's KV moved once
    if decode == "d_dp":  # the KV of each request landed in one rank's pool, both ranks used
        assert sent == landed and set(landed) == {"0", "1"}, (sent, landed)
    elif decode == "d_tp":  # each TP rank's pool received the whole KV of every request
        assert sent == landed and set(landed) == {"0", "1"} and len(set(landed.values())) == 1, (sent, landed)
    else:
        assert set(landed) == {"0"}, landed
    if prefill == "p_dp":  # each request's pages were read on the rank that computed them: both ranks
        read = loads(cluster[prefill])["kv_transfer_bytes_by_prefill_rank"]
        read = {r: n - before[2].get(r, 0) for r, n in read.items() if n - before[2].get(r, 0)}
        assert set(read) == {"0", "1"} and sum(read.values()) == sum(sent.values()), (read, sent)
        assert loads(cluster[prefill])["counters"]["num_transfer_timeout_reqs"] == timeouts + 1
    wait_idle(cluster[prefill], cluster[decode])


def test_requests_migrated_into_and_out_of_a_dp_engine_go_on_as_the_undisturbed_ones(cluster):
    """The engine's half of migration: the router resends a request with the answer so far. A long
    stream holds one rank's pages meanwhile, so each continuation into the DP engine is placed on
    the other rank (the one with the most free pages), where its KV is computed from the resent ids."""
    N = 40
    url = cluster["mono_dp"]
    rng = random.Random(3)
    prompts = {cut: [rng.randrange(2, 500) for _ in range(23)] for cut in (1, 5)}
    whole = {cut: complete(cluster["mono"], p, N) for cut, p in prompts.items()}
    stop = threading.Event()

    def hold_a_rank():  # streams until told to stop, then drops the connection (an abort)
        body = {"prompt": [7] * 30, "max_tokens": 900, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=240) as r:
            for _ in r.iter_lines():
                if stop.is_set():
                    return

    holder = threading.Thread(target=hold_a_rank)
    holder.start()
    try:
        deadline = time.monotonic() + 60
        held = []
        while not held:
            held = [r["rank"] for r in loads(url)["dp_ranks"] if r["running"]]
            assert time.monotonic() < deadline and holder.is_alive(), "the long stream never ran"
            time.sleep(0.01)
        other = 1 - held[0]
        for cut in prompts:  # a tp-1 engine answered `cut` tokens, then failed
            got: list[int] = []
            resend = threading.Thread(
                target=lambda: got.extend(complete(url, prompts[cut], N, AUTH, continuation_token_ids=whole[cut][:cut]))
            )
            resend.start()
            seen_there = False
            while resend.is_alive():
                seen_there |= loads(url)["dp_ranks"][other]["running"] > 0
                time.sleep(0.01)
            assert holder.is_alive(), "the long stream ended early: its rank was free"
            assert seen_there, f"the continuation was not seen on rank {other}"
            assert whole[cut][:cut] + got == whole[cut], cut
    finally:
        stop.set()
        holder.join(240)
    for cut in prompts:  # out of it: the DP engine answered `cut` tokens, then failed; a tp-1 engine goes on
        dp_whole = complete(url, prompts[cut], N)
        assert dp_whole == whole[cut]
        out = complete(cluster["mono"], prompts[cut], N, AUTH, continuation_token_ids=dp_whole[:cut])
        assert dp_whole[:cut] + out == whole[cut], cut
    wait_idle(url)


def test_v4_pd_from_a_dp_prefill_into_a_dp_decode_equals_mono(make_model, tmp_path):
    """DeepSeek-V4 keeps a slot row per request (window ring, compressor stages) besides pages:
    the DP prefill's rank that ran the request writes both from its pool, into the pool of the
    rank the DP decode placed it on (the row id is the same on every rank)."""
    model = make_model("v4-tiny")
    common = ["serve", "--model", model, "--kv-pages", 64, "--page-size", 16, "--served-model-name", "m"]
    common += ["--device", "cpu"]
    m, p, b, d, r = (free_port() for _ in range(5))
    url = {x: f"http://127.0.0.1:{port}" for x, port in (("mono", m), ("p", p), ("d", d), ("r", r))}
    procs = [
        Proc([*common, "--port", m], tmp_path / "mono.log"),
        Proc([*common, "--role", "prefill", "--port", p, "--bootstrap-port", b, *DP], tmp_path / "p.log"),
        Proc([*common, "--role", "decode", "--port", d, *DP], tmp_path / "d.log"),
    ]
    try:
        for name, proc in zip(("mono", "p", "d"), procs):
            proc.wait_ready(url[name], timeout=300)
        procs.append(Proc(["router", "--prefill", url["p"], "--decode", url["d"], "--port", r], tmp_path / "r.log"))
        procs[-1].wait_ready(url["r"], timeout=60)
        rng = random.Random(7)
        prompts = [[rng.randrange(2, 500) for _ in range(n)] for n in (41, 5, 23)]  # past windows, several pages
        results: dict[int, list[int]] = {}

        def one(i):
            time.sleep(0.05 * i)  # staggered: the first holds a decode rank's pages, later ones go to the other
            results[i] = complete(url["r"], prompts[i], 16)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        for i, prompt in enumerate(prompts):
            assert results[i] == complete(url["mono"], prompt, 16), i
        landed = bytes_by_rank(url["d"])
        assert set(landed) == {"0", "1"} and landed == bytes_by_rank(url["p"]), landed
        wait_idle(url["p"], url["d"])
        for u in (url["p"], url["d"]):
            ld = loads(u)
            assert ld["kv_slots_free"] == ld["kv_slots_total"], ld  # every slot row back too
    finally:
        stop_all(procs)
