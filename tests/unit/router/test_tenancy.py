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
