"""When the operator tells the routers to hold (rollout_hold.py): while a role with one replica
rolls to a new template, never for a role with a second replica to serve, nor a set starting."""

from __future__ import annotations

from dsv4_operator.rollout_hold import hold_reason, rolling_alone


def sts(replicas=1, current="a", update="b") -> dict:
    status = {k: v for k, v in (("currentRevision", current), ("updateRevision", update)) if v}
    return {"metadata": {"generation": 2}, "spec": {"replicas": replicas}, "status": status}


def test_only_the_roll_of_a_lone_replica_holds():
    assert rolling_alone(sts())
    assert not rolling_alone(sts(update="a"))  # rolled
    assert not rolling_alone(sts(replicas=2))  # the other replica serves (StatefulSets roll one at a time)
    assert not rolling_alone(sts(current=None))  # starting: nothing served before
    assert not rolling_alone(None) and not rolling_alone({"spec": {"replicas": 1}})
    assert hold_reason({"prefill": sts(), "decode": sts(update="a")}) == (
        "rollout of prefill: the only replica restarts on the new template"
    )
    assert "decode and prefill" in hold_reason({"prefill": sts(), "decode": sts()})
    assert hold_reason({"prefill": sts(update="a"), "decode": None}) is None
