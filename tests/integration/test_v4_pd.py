"""DeepSeek-V4 prefill/decode over real NIXL between real processes, behind the real router.

A V4 hand-off moves paged state (compressed entries, indexer keys) and a slot row (window ring,
compressor stages). PD must equal mono token for token at every window / compression / top-k
boundary and across a growing conversation; a fault (stall, fail, dropped notification,
delayed bootstrap, decode crash) ends within its deadline with every page and slot row back on both sides; --transfer-checksum catches a flipped
byte in a slot or a paged region; with deadlines off a
stalled transfer wedges (inflight stays 1) until aborted, and `dsv4 up --model V4DIR` (PD, with
its watchdog) heals that wedge.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time

import httpx
import pytest

from test_pd import TRANSFER_TIMEOUT, WAITING_TIMEOUT, PDCluster, arm, complete, crash_decode_mid_transfer, loads
from test_up import complete_eventually, start_up, wedge_request, workers

SLACK = 8.0


@pytest.fixture(scope="module")
def v4_dir(make_model):
    return make_model("v4-tiny")


@pytest.fixture(scope="module")
def cluster(v4_dir, tmp_path_factory):
    c = PDCluster(v4_dir, tmp_path_factory.mktemp("v4pd"), decode_args=["--transfer-checksum"])
    yield c
    c.stop()


def wait_idle(*urls: str, timeout: float = 15.0) -> None:
    """Every page and every slot row back, every queue empty."""
    deadline = time.monotonic() + timeout
    for url in urls:
        while True:
            ld = loads(url)
            busy = sum(ld["queues"].values())
            if (
                busy == 0
                and ld["kv_pages_free"] == ld["kv_pages_total"]
                and ld["kv_slots_free"] == ld["kv_slots_total"]
            ):
                break
            assert time.monotonic() < deadline, f"{url} still holds state: {ld}"
            time.sleep(0.05)


def tokens(body: dict) -> list[int]:
    return body["choices"][0]["token_ids"]


def test_v4_pd_equals_mono_across_window_compression_and_top_k(cluster):
    """Staggered, concurrent; v4-tiny: window 8, CSA every 4, HCA every 8, top-4 of the CSA entries."""
    rng = random.Random(13)
    lengths = [5, 8, 9, 16, 17, 45, 70, 100]
    prompts = [[rng.randrange(2, 250) for _ in range(n)] for n in lengths]
    results: dict[int, dict] = {}

    def one(i):
        time.sleep(0.1 * i)
        results[i] = complete(cluster.r_url, prompts[i], max_tokens=12 + i)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    for i, p in enumerate(prompts):
        assert tokens(results[i]) == tokens(complete(cluster.m_url, p, max_tokens=12 + i)), lengths[i]
    wait_idle(cluster.p_url, cluster.d_url)
    ld = loads(cluster.p_url)
    moved = ld["kv_transfer_bytes_by_state"]
    assert {"swa_kv", "csa_kv", "csa_index_k", "hca_kv", "csa_stage", "csa_index_stage", "hca_stage"} <= set(moved)
    assert loads(cluster.d_url)["counters"]["kv_transfer_checksum_failed"] == 0


def test_v4_growing_conversation_equals_mono(cluster):
    rng = random.Random(17)
    history: list[int] = []
    for round_ in range(4):
        history += [rng.randrange(2, 250) for _ in range(15 + 10 * round_)]
        pd = complete(cluster.r_url, history, max_tokens=16)
        assert tokens(pd) == tokens(complete(cluster.m_url, history, max_tokens=16)), round_
        history += tokens(pd)
    assert len(history) > 120
    wait_idle(cluster.p_url, cluster.d_url)


@pytest.mark.parametrize(
    "fault,side,counter,bound",
    [
        ("stall_transfer", "p", "num_transfer_timeout_reqs", TRANSFER_TIMEOUT),
        ("fail_transfer", "p", "num_transfer_failed_reqs", 0.0),
        ("drop_notification", "d", "num_transfer_timeout_reqs", WAITING_TIMEOUT),
    ],
)
def test_v4_transfer_fault_fails_within_its_deadline_then_router_retries(cluster, fault, side, counter, bound):
    """Over real NIXL, with every V4 region in the transfer: the faulted hand-off ends within
    its deadline, the right side counts it, every page and slot row comes back on both sides,
    and the router's retry gives mono's tokens."""
    url = {"p": cluster.p_url, "d": cluster.d_url}[side]
    before = loads(url)["counters"][counter]
    arm(cluster.p_url, fault)
    prompt = list(range(10, 40))  # crosses window, CSA and HCA boundaries
    t0 = time.monotonic()
    out = complete(cluster.r_url, prompt, max_tokens=8)
    assert time.monotonic() - t0 < bound + SLACK, fault
    assert tokens(out) == tokens(complete(cluster.m_url, prompt, max_tokens=8))
    assert loads(url)["counters"][counter] == before + 1
    wait_idle(cluster.p_url, cluster.d_url)


def test_v4_delayed_bootstrap_still_succeeds(cluster):
    arm(cluster.p_url, "delay_bootstrap", seconds=1.0)
    prompt = list(range(50, 71))
    t0 = time.monotonic()
    out = complete(cluster.r_url, prompt, max_tokens=6)
    assert time.monotonic() - t0 >= 0.9
    assert tokens(out) == tokens(complete(cluster.m_url, prompt, max_tokens=6))
    wait_idle(cluster.p_url, cluster.d_url)


def pair_request(cluster, body: dict) -> tuple[httpx.Response, httpx.Response]:
    """Straight to the pair (no router retry): prefill and decode legs at once."""
    res = {}
    t = threading.Thread(
        target=lambda: res.update(p=httpx.post(f"{cluster.p_url}/v1/completions", json=body, timeout=60))
    )
    t.start()
    d = httpx.post(f"{cluster.d_url}/v1/completions", json=body, timeout=60)
    t.join(60)
    return res["p"], d


@pytest.mark.parametrize("state", ["swa_kv", "csa_kv"])
def test_v4_corrupted_slot_or_page_region_fails_the_request_with_checksum_on(cluster, state):
    before = loads(cluster.d_url)["counters"]
    arm(cluster.p_url, "corrupt_transfer", state=state)
    body = {
        "prompt": list(range(5, 40)),
        "max_tokens": 4,
        "temperature": 0,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": cluster.b_port,
        "bootstrap_room": {"swa_kv": 515151, "csa_kv": 515152}[state],
    }
    p, d = pair_request(cluster, body)
    assert p.status_code == 200  # prefill's part went through; what landed differs
    assert d.status_code == 502 and f"checksum mismatch in region(s) {state}" in d.json()["error"]["message"], d.text
    after = loads(cluster.d_url)["counters"]
    assert after["kv_transfer_checksum_failed"] == before["kv_transfer_checksum_failed"] + 1
    assert "dsv4:kv_transfer_checksum_failed_total" in httpx.get(f"{cluster.d_url}/metrics").text
    wait_idle(cluster.p_url, cluster.d_url)
    # the flipped byte was put back on prefill: the next request is exact
    prompt = list(range(5, 40))
    assert tokens(complete(cluster.r_url, prompt, max_tokens=6)) == tokens(
        complete(cluster.m_url, prompt, max_tokens=6)
    )


def test_v4_wedge_with_deadlines_off_holds_until_aborted(cluster):
    """disable_deadlines on both engines + a stalled transfer: the production wedge, on V4."""
    for url in (cluster.p_url, cluster.d_url):
        arm(url, "disable_deadlines", count=-1)
    try:
        arm(cluster.p_url, "stall_transfer")
        body = {
            "prompt": list(range(20, 60)),
            "max_tokens": 4,
            "temperature": 0,
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": cluster.b_port,
            "bootstrap_room": 626262,
        }
        res = {}
        t = threading.Thread(target=lambda: res.update(pd=pair_request(cluster, body)))
        t.start()
        deadline = time.monotonic() + 60
        while loads(cluster.p_url)["queues"]["inflight"] != 1:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        time.sleep(TRANSFER_TIMEOUT + 2.0)  # past every deadline the engines would keep
        ld = loads(cluster.p_url)
        assert ld["queues"]["inflight"] == 1 and ld["prefill_inflight_oldest_age_seconds"] > TRANSFER_TIMEOUT
        assert ld["kv_slots_free"] == ld["kv_slots_total"] - 1  # the wedge pins a slot row too
        assert loads(cluster.d_url)["queues"]["transfer"] == 1
        httpx.post(f"{cluster.p_url}/admin/abort", json={"all": True}, timeout=10).raise_for_status()
        t.join(30)
        p, d = res["pd"]
        assert p.status_code == 503 and d.status_code == 502
    finally:
        for url in (cluster.p_url, cluster.d_url):
            httpx.delete(f"{url}/admin/faults", timeout=10)
    wait_idle(cluster.p_url, cluster.d_url)


def test_v4_decode_crash_frees_prefill_pages_and_slot_row_and_traffic_recovers(cluster):
    """Last of the cluster's tests: the decode it restarts runs without --transfer-checksum."""
    crash_decode_mid_transfer(cluster, room=737373, slack=SLACK)
    wait_idle(cluster.p_url)  # prefill's pages and slot row are back
    cluster.restart_decode()
    prompt = list(range(40, 75))
    deadline = time.monotonic() + 30
    while True:  # the router notices the new decode at its next health check
        r = httpx.post(
            f"{cluster.r_url}/v1/completions",
            json={"prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "return_token_ids": True},
            timeout=60,
        )
        if r.status_code == 200:
            break
        assert time.monotonic() < deadline, r.text
        time.sleep(0.5)
    assert tokens(r.json()) == tokens(complete(cluster.m_url, prompt, max_tokens=5))
    wait_idle(cluster.p_url, cluster.d_url)


def test_up_runs_v4_in_pd_and_its_watchdog_heals_a_v4_wedge(tmp_path, v4_dir):
    up = start_up(tmp_path, v4_dir, "--no-deadlines")
    try:
        assert complete_eventually(up.url)["usage"]["completion_tokens"] == 4  # through prefill -> decode
        prefill = workers(up)["prefill"]["url"]
        assert httpx.get(f"{prefill}/v1/loads", headers=up.admin).json()["kv_transfer_bytes_by_state"]["swa_kv"] > 0
        old = httpx.get(f"{prefill}/server_info").json()["boot_id"]
        httpx.post(
            f"{prefill}/admin/faults", json={"fault": "stall_transfer", "count": 1}, headers=up.admin
        ).raise_for_status()
        t = wedge_request(up.url)
        deadline = time.monotonic() + 60
        while not any(p.name.startswith("local-evidence-prefill") for p in up.evidence.glob("*")):
            assert time.monotonic() < deadline, up.proc.log()
            time.sleep(0.3)
        folder = next(p for p in up.evidence.glob("local-evidence-prefill*"))
        assert json.loads((folder / "verdict.json").read_text())["reason"] == "stuck_inflight"
        assert json.loads((folder / "loads.json").read_text())["queues"]["inflight"] == 1
        t.join(60)
        assert complete_eventually(up.url)["usage"]["completion_tokens"] == 4  # healed
        assert httpx.get(f"{prefill}/server_info").json()["boot_id"] != old
    finally:
        up.proc.stop()


@pytest.mark.slow  # three engines load V4-Flash's real per-layer widths (765 MB fp32 each): minutes on two cores
def test_v4_flash_shape_pd_equals_mono(make_model, tmp_path):
    """V4-Flash's widths (head_dim 512, 64 heads, window 128, CSA every 4, HCA every 128): a
    prompt inside the window, one across the window and the first HCA window, and one past it."""
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # three engines on two shared cores: spinning threads only slow them
    try:
        # a flash-shape prefill takes seconds here: decode's wait for the KV starts before it
        c = PDCluster(
            make_model("v4-flash-shape"),
            tmp_path,
            prefill_args=["--bootstrap-timeout", 60],
            decode_args=["--transfer-checksum", "--waiting-timeout", 300, "--bootstrap-timeout", 60],
        )
    finally:
        os.environ.pop("OMP_NUM_THREADS") if saved is None else os.environ.__setitem__("OMP_NUM_THREADS", saved)
    try:
        rng = random.Random(23)
        for n in (20, 129, 140):
            p = [rng.randrange(2, 250) for _ in range(n)]
            assert tokens(complete(c.r_url, p, max_tokens=4)) == tokens(complete(c.m_url, p, max_tokens=4)), n
        wait_idle(c.p_url, c.d_url)
        assert loads(c.d_url)["counters"]["kv_transfer_checksum_failed"] == 0
    finally:
        c.stop()


# What every summary of `dsv4 bench` carries (tests/unit/cli/test_bench_smoke.py checks the same).
BENCH_SUMMARY_FIELDS = {
    "requests",
    "errors",
    "completion_tokens",
    "wall_s",
    "output_tok_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "runs_tok_s",
    "load_average",
}


def test_bench_pd_quick_on_v4_reports_bytes_by_state_and_checksum_cost(v4_dir, tmp_path):
    """`dsv4 bench pd --quick` on a V4 checkpoint with --transfer-checksum: a smoke run, not a figure.
    The default run's only `bench pd` smoke (the tiny-model one, test_bench_smoke.py's
    test_bench_pd_quick, is behind `slow`): the report's shape is checked here too."""
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "dsv4_cli",
            "bench",
            "pd",
            "--quick",
            "--model",
            str(v4_dir),
            "--transfer-checksum",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads((tmp_path / "pd.json").read_text())
    assert report["settings"]["transfer_checksum"] is True and report["model"]["model_type"] == "deepseek_v4"
    assert (tmp_path / "pd.png").stat().st_size > 10_000
    assert set(report) >= {"mono", "pd", "comparison", "targets", "workloads", "machine"}
    pd, mono = report["pd"]["c2"], report["mono"]["c2"]
    assert BENCH_SUMMARY_FIELDS <= set(pd) and BENCH_SUMMARY_FIELDS <= set(mono)
    assert pd["errors"] == 0 and mono["errors"] == 0
    t = pd["transfer"]
    # Every request of the measured run moved its KV once, and both engines saw it.
    assert t["prefill"]["transfers"] == t["decode"]["transfers"] == pd["requests"]
    assert t["bytes"] > 0 and t["prefill"]["latency_mean_ms"] > 0
    assert t["prefill"]["engine_ttft_mean_ms"] > 0 and t["decode"]["engine_ttft_mean_ms"] > 0
    assert isinstance(report["comparison"]["c2"]["handoff_share_of_ttft"], float)
    assert [x["name"].split(":")[0] for x in report["targets"]] == ["c2"]
    per_req, per_tok = t["bytes_per_transfer_by_state"], t["bytes_per_prompt_token_by_state"]
    slot_row = report["model"]["state_bytes_per_request"]
    assert {name: per_req[name] for name in slot_row} == slot_row  # one slot row per request
    assert per_tok["csa_kv"] > 0 and sum(t["bytes_by_state"].values()) == t["bytes"]
    assert t["checksum_ms_per_transfer"]["prefill"] > 0 and t["checksum_ms_per_transfer"]["decode"] > 0
    assert "KV hand-off by state" in r.stdout
