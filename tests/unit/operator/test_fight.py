"""Back-off against a writer that keeps changing a child."""

from dsv4_operator.fight import FightTracker, other_manager


def test_repairs_back_off_after_a_few_and_warn_once() -> None:
    tracker, key, t = FightTracker(window=60, threshold=3, base=5, cap=40), "Service/x", 0.0
    delays, warnings = [], 0
    for _ in range(12):  # a writer changing the child every 0.2 s; repairs made when due
        decision = tracker.decide(key, t)
        delays.append(decision.delay)
        warnings += decision.warn
        t += decision.delay
        tracker.repaired(key, t, backed_off=decision.delay > 0)
        t += 0.2
    assert delays[:3] == [0, 0, 0]
    assert delays[3:8] == [5, 10, 20, 40, 40]  # doubling, capped
    assert warnings == 1
    assert tracker.decide(key, t + 81).delay == 0, "left alone for a while: the fight is over"


def test_other_manager_is_the_latest_foreign_writer() -> None:
    fields = [
        {"manager": "dsv4-operator", "time": "2026-01-01T00:00:09Z"},
        {"manager": "kubectl-edit", "time": "2026-01-01T00:00:01Z"},
        {"manager": "webhook", "time": "2026-01-01T00:00:05Z"},
    ]
    assert other_manager(fields, ["dsv4-operator"]) == "webhook"
    assert other_manager([], ["dsv4-operator"]) is None
