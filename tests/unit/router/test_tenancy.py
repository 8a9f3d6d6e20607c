"""Per-key decisions (pure): key files, the metrics name of a key, the limiter, the derived salt."""

import pytest

from dsv4_router.tenancy import KeyLimiter, TenantLimits, derived_salt
from dsv4_wire.api_keys import ApiKey, KeyRing, key_id, load_api_keys, parse_key_lines, protected


def test_key_files_name_keys_and_metrics_never_hold_a_key(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# comment\nalice sk-alice\n\nsk-anon  # trailing comment\n")
    keys = load_api_keys(["sk-flag"], [str(f)])
    assert [k.name for k in keys] == [key_id("sk-flag"), "alice", key_id("sk-anon")]
    assert key_id("sk-anon").startswith("key-") and "sk-anon" not in key_id("sk-anon")
    with pytest.raises(ValueError, match="given twice"):
        load_api_keys(["sk-alice"], [str(f)])
    with pytest.raises(ValueError, match="KEY or NAME KEY"):
        parse_key_lines("a b c")
    with pytest.raises(ValueError, match="--api-key-file"):
        load_api_keys([], [str(tmp_path / "missing")])


def test_the_ring_finds_the_key_and_the_internal_token():
    ring = KeyRing([ApiKey("alice", "sk-a")], internal="pd-secret")
    assert ring.identify({"authorization": "Bearer sk-a"}).name == "alice"
    assert ring.identify({"authorization": "Bearer pd-secret"}).name == "internal"
    assert ring.identify({"authorization": "Bearer nope"}) is None and ring.identify({}) is None
    assert protected("/v1/completions") and protected("/v1/models")
    assert not protected("/v1/loads") and not protected("/metrics") and not protected("/health")


def test_concurrency_is_per_key():
    lim = KeyLimiter(TenantLimits(max_concurrency=2))
    assert lim.admit("a", 0) is None and lim.admit("a", 0) is None
    assert lim.admit("a", 0) == ("concurrency", 1)
    assert lim.admit("b", 0) is None  # another key is not held back
    lim.release("a")
    assert lim.admit("a", 0) is None


def test_rate_is_a_token_bucket_per_key_with_a_retry_after():
    lim = KeyLimiter(TenantLimits(rate=0.5, burst=2))
    assert lim.admit("a", 0.0) is None and lim.admit("a", 0.0) is None
    assert lim.admit("a", 0.0) == ("rate", 2)  # one token takes 2 s at 0.5/s
    assert lim.admit("b", 0.0) is None
    assert lim.admit("a", 1.0) == ("rate", 1)
    assert lim.admit("a", 2.0) is None


def test_a_derived_salt_is_per_key_and_a_client_salt_stays_under_its_key():
    a, b = ApiKey("a", "sk-a"), ApiKey("b", "sk-b")
    assert derived_salt(a, None) != derived_salt(b, None)
    assert "sk-a" not in derived_salt(a, None)
    assert derived_salt(b, derived_salt(a, None)) != derived_salt(a, None)
    assert derived_salt(a, "x").startswith(derived_salt(a, None) + ":")


def test_each_key_has_its_own_cache_namespace_by_default():
    """Issue 39 item 11: with keys configured, salting is on unless opted out."""
    from dsv4_router.router_args import RouterArgs
    from dsv4_router.tenancy import salt_per_key

    assert salt_per_key(has_keys=True, shared_prefix_cache=False)
    assert not salt_per_key(has_keys=True, shared_prefix_cache=True)
    assert not salt_per_key(has_keys=False, shared_prefix_cache=False)
    assert RouterArgs().shared_prefix_cache is False and RouterArgs().cache_salt_from_api_key is False


def test_limits_count_sequences_not_requests():
    """Issue 39 item 8: one request of 256 prompts x n=16 counted as one request."""
    from dsv4_wire.sequences import MAX_SEQUENCES_PER_REQUEST, sequence_count

    assert sequence_count({"prompt": ["a"] * 256, "n": 16}) == 4096 > MAX_SEQUENCES_PER_REQUEST
    assert sequence_count({"prompt": [[1, 2]] * 3, "n": 2, "best_of": 4}) == 12
    assert sequence_count({"prompt": [1, 2, 3], "n": True}) == 1  # one token-id prompt; a bool is no count
    assert sequence_count({"messages": [], "n": 4}) == 4
    lim = KeyLimiter(TenantLimits(max_concurrency=8))
    assert lim.admit("a", 0, sequences=6) is None
    assert lim.admit("a", 0, sequences=4) == ("concurrency", 1)  # 6 + 4 > 8
    assert lim.admit("a", 0, sequences=2) is None
    lim.release("a", 8)
    assert lim.admit("a", 0, sequences=16) is None  # alone in flight: let in, never starved
    rate = KeyLimiter(TenantLimits(rate=1.0, burst=4))
    assert rate.admit("a", 0.0, sequences=16) is None  # a full bucket lets a big one in, in debt
    assert rate.over("a", 0.0) == ("rate", 13)
    assert rate.admit("a", 12.0, sequences=1) == ("rate", 1)
    assert rate.over("b", 0.0) is None


async def test_the_gate_charges_the_sequences_the_router_counts():
    from prometheus_client import CollectorRegistry

    from dsv4_router.tenancy import TenantGate, TenantMetrics, admit_sequences

    answers = []

    async def router(scope, receive, send):  # what the router does once it has parsed the body
        answers.append(admit_sequences(scope, scope["sequences"]))

    gate = TenantGate(router, KeyLimiter(TenantLimits(max_concurrency=4)), TenantMetrics(CollectorRegistry()))
    key = ApiKey("alice", "sk-a")
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "dsv4.api_key": key}
    gate.limiter.admit("alice", 0.0, 3)  # another request of alice's, 3 sequences, in flight
    await gate({**scope, "sequences": 2}, None, None)
    assert answers[-1] is not None and answers[-1].status == 429 and answers[-1].code == "key_concurrency_limit"
    await gate({**scope, "sequences": 1}, None, None)
    assert answers[-1] is None and gate.limiter.inflight("alice") == 3  # released when it ended
