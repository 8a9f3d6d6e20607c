"""Hangs nobody else sees (issue 45): pure verdicts over one pod's window of samples, beside the
hand-off and scheduler rules of detector.py, with the same rule: slow is not wedged, so each
needs its condition to hold for the whole window.

* ``clients_waiting_idle``: the engine's HTTP process holds requests that had no output from its
  core (``http_waiting`` > 0) while the core has nothing at all (no request running or queued in
  any queue, PD's included) and takes nothing in: the requests never reached it (a tokenizer
  queue overflowing, a lost hand-over), and /health stays green.
* ``pd_not_exchanging``: a PD engine keeps receiving requests (its prompt-token counter grew in
  the window's first half) but not one KV transfer completes nor any byte moves (prefill), or not
  one token is generated (decode), for the whole window, and now holds nothing (pending
  hand-offs are the stuck_* rules' to judge, a core at work the stall rule's): the pair is configured but exchanges nothing,
  every request failing before its hand-off (a bootstrap that always fails, a peer never told).
* ``router_stalled`` (a router's samples, role ``router``): requests wait inside the router
  (admitted or queued) for the whole window and it sends none to any engine: the router itself
  is the wedge point while the engines idle.
"""

from __future__ import annotations

from typing import Any, Optional

from .signals import EngineSample

CLIENTS_WAITING_IDLE = "clients_waiting_idle"
PD_NOT_EXCHANGING = "pd_not_exchanging"
ROUTER_STALLED = "router_stalled"

_QUEUES = ("num_running", "num_queue", "bootstrap_queue", "prefill_inflight", "decode_prealloc", "decode_transfer")


def _core_idle(s: EngineSample) -> bool:
    return all(not (getattr(s, q) or 0) for q in _QUEUES)


def _grew(prev: EngineSample, cur: EngineSample, name: str) -> bool:
    a, b = getattr(prev, name), getattr(cur, name)
    return a is not None and b is not None and b > a


def _held_for(seq: list[EngineSample], holds, moved) -> float:
    """Seconds up to the latest sample for which `holds(sample)` was true of every sample and
    `moved(prev, cur)` of no pair of them."""
    latest = seq[-1]
    if not holds(latest):
        return 0.0
    start = latest.timestamp
    for i in range(len(seq) - 1, 0, -1):
        prev, cur = seq[i - 1], seq[i]
        if not holds(prev) or moved(prev, cur):
            break
        start = prev.timestamp
    return latest.timestamp - start


def clients_waiting_idle(seq: list[EngineSample], window_s: float) -> Optional[tuple[str, dict[str, Any]]]:
    """(reason, details) when clients waited on an idle core for the whole window, else None."""
    latest = seq[-1]
    if latest.http_waiting is None:
        return None
    waited = _held_for(
        seq,
        lambda s: bool(s.http_waiting) and _core_idle(s),
        lambda a, b: _grew(a, b, "prompt_tokens") or _grew(a, b, "generation_tokens"),
    )
    if waited < window_s:
        return None
    return CLIENTS_WAITING_IDLE, {
        "http_waiting": latest.http_waiting,
        "idle_seconds": round(waited, 3),
        "window_seconds": window_s,
        "why": "the HTTP server holds requests the engine core never got; the core is idle",
    }


def _value_at(seq: list[EngineSample], t: float, name: str) -> Optional[float]:
    """The counter's last value at or before time t."""
    found = None
    for s in seq:
        if s.timestamp > t:
            break
        if getattr(s, name) is not None:
            found = getattr(s, name)
    return found


def _increase(seq: list[EngineSample], name: str) -> Optional[float]:
    values = [getattr(s, name) for s in seq if getattr(s, name) is not None]
    return None if not values else max(values[-1] - values[0], 0.0)


def pd_not_exchanging(seq: list[EngineSample], window_s: float, covered: bool) -> Optional[tuple[str, dict[str, Any]]]:
    latest = seq[-1]
    if not covered or latest.role not in ("prefill", "decode") or not _core_idle(latest):
        return None  # a core at work (a long prefill) is judged by the stall rule, not this one
    first, mid = seq[0], _value_at(seq, latest.timestamp - window_s / 2, "prompt_tokens")
    if first.prompt_tokens is None or mid is None or mid <= first.prompt_tokens:
        return None  # no requests arrived early enough in the window to have been handed over
    if latest.role == "prefill":
        if latest.prefill_inflight or latest.bootstrap_queue:
            return None  # pending hand-offs: the stuck_inflight rule's
        # a room decode served from its own cache (--decode-local-prefill) moves no KV by design
        moved = [
            _increase(seq, "transfers_completed"),
            _increase(seq, "transfer_bytes"),
            _increase(seq, "decode_local"),
        ]
    else:
        if latest.decode_transfer or latest.decode_prealloc:
            return None  # waiting for KV: the stuck_transfer rule's
        moved = [_increase(seq, "transfers_completed"), _increase(seq, "generation_tokens")]
    known = [m for m in moved if m is not None]
    if not known or any(m > 0 for m in known):
        return None
    failed = {
        name: _increase(seq, name)
        for name in ("bootstrap_failed", "transfer_failed", "transfer_timeout", "aborted")
        if _increase(seq, name) is not None
    }
    return PD_NOT_EXCHANGING, {
        "role": latest.role,
        "prompt_tokens_received": _increase(seq, "prompt_tokens"),
        "window_seconds": window_s,
        "failed_in_window": failed,
        "why": "requests keep arriving but no KV is exchanged with the peer role",
    }


def router_stalled(seq: list[EngineSample], window_s: float) -> Optional[tuple[str, dict[str, Any]]]:
    latest = seq[-1]
    if latest.role != "router" or latest.router_held is None or latest.router_sent is None:
        return None
    if latest.router_hold_left:  # a planned change (a roll) holds them on purpose until an engine is back
        return None
    # requests waiting for a healthy engine are the engines' outage (the supervisor's or the
    # watchdog's to mend), not the router's wedge
    stalled = _held_for(
        seq, lambda s: (s.router_held or 0) > (s.router_engine_wait or 0), lambda a, b: _grew(a, b, "router_sent")
    )
    if stalled < window_s:
        return None
    return ROUTER_STALLED, {
        "requests_held": latest.router_held,
        "stalled_seconds": round(stalled, 3),
        "window_seconds": window_s,
        "why": "requests wait inside the router and it sends none to any engine",
    }
