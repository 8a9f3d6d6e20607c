"""The leader Lease's rules, pure: who takes, renews or waits, judged on the candidate's own clock."""

import pytest

from dsv4_operator.leader import (
    ACQUIRE,
    RENEW,
    WAIT,
    LeaderElection,
    LeaseView,
    decide,
    lease_namespace,
    lease_spec,
)


def test_a_free_lease_is_taken_and_ones_own_is_renewed():
    assert decide(LeaseView(None, None), "a", None, 0.0, 15) == ACQUIRE
    assert decide(LeaseView("a", "t1"), "a", 0.0, 100.0, 15) == RENEW


def test_another_holder_is_waited_for_until_it_stops_renewing_on_our_clock():
    held = LeaseView("b", "2000-01-01T00:00:00.000000Z")  # an old renewTime says nothing: clocks differ
    assert decide(held, "a", None, 1000.0, 15) == WAIT  # never seen before: start watching it
    assert decide(held, "a", 1000.0, 1014.9, 15) == WAIT
    assert decide(held, "a", 1000.0, 1015.0, 15) == ACQUIRE


def test_the_lease_spec_counts_transitions_only_when_taken_from_another():
    spec = lease_spec(LeaseView("b", "x", transitions=3, acquire_time="t0"), "a", ACQUIRE, 0.0, 15)
    assert spec["holderIdentity"] == "a" and spec["leaseTransitions"] == 4 and spec["leaseDurationSeconds"] == 15
    assert spec["renewTime"] == spec["acquireTime"] == "1970-01-01T00:00:00.000000Z"
    renewed = lease_spec(LeaseView("a", "x", transitions=4, acquire_time="t0"), "a", RENEW, 5.0, 15)
    assert renewed["acquireTime"] == "t0" and renewed["leaseTransitions"] == 4
    assert lease_spec(LeaseView(None, None), "a", ACQUIRE, 0.0, 15)["leaseTransitions"] == 0


def test_settings_must_let_the_holder_stop_before_another_may_take_over():
    with pytest.raises(ValueError):
        LeaderElection(namespace="ns", lease_s=10, renew_deadline_s=10, retry_s=2)
    LeaderElection(namespace="ns", lease_s=15, renew_deadline_s=10, retry_s=2)


def test_lease_namespace(tmp_path):
    assert lease_namespace({"POD_NAMESPACE": "ops"}) == "ops"
    f = tmp_path / "namespace"
    f.write_text("dsv4-system\n")
    assert lease_namespace({}, str(f)) == "dsv4-system"
    assert lease_namespace({}, str(tmp_path / "missing")) == "default"
