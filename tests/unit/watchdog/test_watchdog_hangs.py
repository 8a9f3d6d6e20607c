"""The hangs nobody else sees (watchdog/hangs.py, through the Detector): clients waiting on an
idle core, a PD pair that exchanges nothing, a router that holds requests and sends none. Each
needs its condition for the whole window (slow is not wedged); the evidence says why."""

from __future__ import annotations

from dsv4_operator.watchdog.detector import Detector, Reason, Wedged
from dsv4_operator.watchdog.signals import BUILTIN, ROUTER, EngineSample, build_sample

WINDOW = 60.0


def run(samples: list[EngineSample]) -> list:
    d = Detector(window_s=WINDOW)
    return [d.observe("p", s) for s in samples]


def idle(t, role="mono", **kw) -> EngineSample:
    base = dict(
        num_running=0,
        num_queue=0,
        generation_tokens=100.0,
        prompt_tokens=50.0,
        loop_iterations=t * 100,
        transfers_completed=5.0,
        transfer_bytes=1000.0,
    )
    return EngineSample(timestamp=t, role=role, reachable=True, kind=BUILTIN, **{**base, **kw})


def wedged(results) -> list:
    return [v for v in results if isinstance(v, Wedged)]


def test_clients_waiting_on_an_idle_core_for_the_window_is_a_wedge_with_evidence():
    got = run([idle(t, http_waiting=7) for t in range(0, 70, 5)])
    first = next(i for i, v in enumerate(got) if isinstance(v, Wedged))
    assert first == 12  # at t = 60: the whole window, not before
    v = got[first]
    assert v.reason == Reason.CLIENTS_WAITING_IDLE and v.details["http_waiting"] == 7
    assert "never got" in v.details["why"]


def test_clients_waiting_while_the_core_works_or_takes_requests_in_is_not():
    busy = run([idle(t, http_waiting=7, num_running=2, generation_tokens=100.0 + t) for t in range(0, 200, 5)])
    assert not wedged(busy)
    # requests reach the core now and then: the waiting ones are a queue, not a hang
    arriving = run([idle(t, http_waiting=3, prompt_tokens=50.0 + (t // 20)) for t in range(0, 200, 5)])
    assert not wedged(arriving)
    # no one waiting: an idle engine is just idle
    assert not wedged(run([idle(t, http_waiting=0) for t in range(0, 200, 5)]))


def test_a_prefill_taking_requests_and_never_handing_one_over_is_pd_not_exchanging():
    got = run(
        [
            idle(t, role="prefill", prompt_tokens=50.0 + 10 * t, bootstrap_failed=t / 5, prefill_inflight=0)
            for t in range(0, 90, 5)
        ]
    )
    w = wedged(got)
    assert w and w[0].reason == Reason.PD_NOT_EXCHANGING
    assert w[0].details["failed_in_window"]["bootstrap_failed"] > 0


def test_a_pd_pair_that_hands_over_now_and_then_is_not():
    got = run(
        [
            idle(t, role="prefill", prompt_tokens=50.0 + 10 * t, transfers_completed=5.0 + t // 30)
            for t in range(0, 200, 5)
        ]
    )
    assert not wedged(got)
    # a decode that generates is exchanging
    dec = run([idle(t, role="decode", prompt_tokens=50.0 + t, generation_tokens=100.0 + t) for t in range(0, 200, 5)])
    assert not wedged(dec)


def test_a_prefill_whose_rooms_decode_serves_from_its_own_cache_is_not_pd_not_exchanging():
    """--decode-local-prefill (on by default): every later round of a conversation is served by
    decode from its cache, so prefill receives requests, ends them as `local` rooms and moves no
    KV. That is a hand-off by agreement, not a pair that exchanges nothing."""
    samples = [
        idle(t, role="prefill", prompt_tokens=50.0 + 10 * t, decode_local=2.0 * t, prefill_inflight=0)
        for t in range(0, 120, 5)
    ]
    assert not wedged(run(samples))
    # read from both views the watchdog scrapes
    metrics = "dsv4:num_decode_local_reqs_total 7\n"
    assert build_sample(0.0, "prefill", metrics_text=metrics).decode_local == 7.0
    loads = {"role": "prefill", "counters": {"num_decode_local_reqs": 3}}
    assert build_sample(0.0, "prefill", loads=loads).decode_local == 3.0
    # the rule still fires when neither a transfer nor a local room moves
    still = [idle(t, role="prefill", prompt_tokens=50.0 + 10 * t, decode_local=4.0) for t in range(0, 120, 5)]
    assert wedged(run(still))


def test_a_decode_receiving_requests_and_generating_nothing_is_pd_not_exchanging():
    got = run([idle(t, role="decode", prompt_tokens=50.0 + 10 * t, transfers_completed=None) for t in range(0, 90, 5)])
    w = wedged(got)
    assert w and w[0].reason == Reason.PD_NOT_EXCHANGING and w[0].details["role"] == "decode"


def router(t, held, sent) -> EngineSample:
    text = (
        f"dsv4_router:inflight_requests {held}\n"
        "dsv4_router:queued_requests 0\n"
        f'dsv4_router:worker_requests_total{{worker="http://d",role="decode"}} {sent}\n'
    )
    return build_sample(t, "router", ROUTER, metrics_text=text)


def test_a_router_holding_requests_and_sending_none_is_router_stalled():
    got = run([router(t, 12, 400) for t in range(0, 70, 5)])
    w = wedged(got)
    assert w and w[0].reason == Reason.ROUTER_STALLED and w[0].details["requests_held"] == 12
    moving = run([router(t, 12, 400 + t) for t in range(0, 200, 5)])
    assert not wedged(moving)
    assert not wedged(run([router(t, 0, 400) for t in range(0, 200, 5)]))


def test_requests_held_through_a_planned_change_are_no_router_wedge():
    """A roll of a one-replica role holds new requests at the router (POST /admin/hold) until the
    engine is back: held, none sent, for longer than the window, and not the router's fault."""

    sent = 'dsv4_router:worker_requests_total{worker="x",role="decode"} 400\n'

    def holding(t: float, left: float) -> EngineSample:
        text = f"dsv4_router:inflight_requests 12\ndsv4_router:planned_hold_seconds {left}\n"
        return build_sample(t, "router", ROUTER, metrics_text=text + sent)

    assert (
        build_sample(0, "router", ROUTER, metrics_text="dsv4_router:planned_hold_seconds 30\n").router_hold_left == 30
    )
    assert not wedged(run([holding(t, 200.0 - t) for t in range(0, 120, 5)]))
    # the hold lapsed, the router still holds and sends nothing: a wedge once the window has passed
    assert wedged(run([holding(t, 0.0) for t in range(0, 70, 5)]))

    def waiting(t: float, n: int) -> EngineSample:  # held because no engine (pair) is healthy
        text = f"dsv4_router:inflight_requests 12\ndsv4_router:engine_wait_requests {n}\n"
        return build_sample(t, "router", ROUTER, metrics_text=text + sent)

    assert not wedged(run([waiting(t, 12) for t in range(0, 120, 5)]))  # the engines' outage, not the router's
    assert wedged(run([waiting(t, 3) for t in range(0, 70, 5)]))  # nine stuck in the router itself


def test_the_engines_http_waiting_gauge_is_read_from_metrics_and_loads():
    text = 'dsv4:num_http_waiting_reqs{model_name="m",role="mono"} 4\n'
    assert build_sample(0, "mono", metrics_text=text).http_waiting == 4
    assert build_sample(0, "mono", loads={"queues": {}, "http_waiting": 2}).http_waiting == 2
