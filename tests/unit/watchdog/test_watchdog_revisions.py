"""Spec revisions: hashing, stable marking, naming a change, correlating wedges, rollback."""

import copy

import pytest

from dsv4_operator.pinning import revision_spec
from dsv4_operator.watchdog.revisions import (
    Revision,
    RevisionTracker,
    correlate,
    decide_rollback,
    describe_change,
    spec_hash,
)

BASE = {
    "model": {"name": "dsv4-flash", "source": {"pvc": "models"}},
    "engine": {
        "kind": "sglang",
        "image": "lmsysorg/sglang:v0.5.4",
        "extraArgs": ["--disaggregation-transfer-backend", "nixl"],
    },
    "prefill": {"replicas": 2, "env": [{"name": "UCX_NET_DEVICES", "value": "mlx5_0:1"}]},
    "decode": {"replicas": 2, "env": [{"name": "FOO", "value": "1"}, {"name": "SGLANG_DEBUG_HOOK", "value": "0"}]},
    "remediation": {"enabled": True, "rollback": "auto"},
}


def with_changes(spec, fn):
    new = copy.deepcopy(spec)
    fn(new)
    return new


def decode_env(spec, name, value):
    for item in spec["decode"]["env"]:
        if item["name"] == name:
            item["value"] = value


# --- hashing -------------------------------------------------------------------------------------


def test_hash_ignores_key_order_and_remediation():
    reordered = dict(reversed(list(BASE.items())))
    assert spec_hash(reordered) == spec_hash(BASE)
    tweaked = with_changes(BASE, lambda s: s["remediation"].update(dryRun=True))
    assert spec_hash(tweaked) == spec_hash(BASE)
    changed = with_changes(BASE, lambda s: decode_env(s, "FOO", "512"))
    assert spec_hash(changed) != spec_hash(BASE)
    assert len(spec_hash(BASE)) == 16


# --- naming a change -------------------------------------------------------------------------------


def test_decode_env_change_in_words():
    new = with_changes(BASE, lambda s: decode_env(s, "FOO", "512"))
    assert describe_change(BASE, new) == ["decode.env FOO changed from 1 to 512"]


def test_env_added_removed_and_map_form():
    def edit(s):
        s["decode"]["env"] = [{"name": "FOO", "value": "1"}, {"name": "BAR", "value": "x"}]

    assert describe_change(BASE, with_changes(BASE, edit)) == [
        "decode.env BAR added (=x)",
        "decode.env SGLANG_DEBUG_HOOK removed (was 0)",
    ]
    old = {"engine": {"env": {"A": "1", "B": "2"}}}
    new = {"engine": {"env": {"A": "3", "C": "4"}}}
    assert describe_change(old, new) == [
        "engine.env A changed from 1 to 3",
        "engine.env B removed (was 2)",
        "engine.env C added (=4)",
    ]


def test_image_scalars_lists_and_sections():
    def edit(s):
        s["engine"]["image"] = "lmsysorg/sglang:v0.5.5"
        s["prefill"]["replicas"] = 3
        s["engine"]["extraArgs"] = ["--disaggregation-transfer-backend", "mooncake"]
        s["router"] = {"replicas": 1}
        del s["model"]["source"]

    changes = describe_change(BASE, with_changes(BASE, edit))
    assert changes == [
        'engine.extraArgs changed from ["--disaggregation-transfer-backend", "nixl"] to '
        '["--disaggregation-transfer-backend", "mooncake"]',
        "engine.image changed from lmsysorg/sglang:v0.5.4 to lmsysorg/sglang:v0.5.5",
        'model.source removed (was {"pvc": "models"})',
        "prefill.replicas changed from 2 to 3",
        'router added (={"replicas": 1})',
    ]
    assert describe_change(BASE, BASE) == []


def test_named_list_items_and_long_values():
    old = {"prefill": {"tolerations": [{"name": "gpu", "effect": "NoSchedule"}]}}
    new = {"prefill": {"tolerations": [{"name": "gpu", "effect": "NoExecute"}, {"name": "spot"}]}}
    assert describe_change(old, new) == [
        "prefill.tolerations[gpu].effect changed from NoSchedule to NoExecute",
        "prefill.tolerations[spot] added",
    ]
    long = describe_change({"x": "a" * 500}, {"x": "b"})[0]
    assert len(long) < 120 and long.endswith("to b")


# --- tracker ---------------------------------------------------------------------------------------


def test_revision_becomes_stable_after_quiet_period_wedges_postpone_it():
    tr = RevisionTracker(quiet_period_s=600)
    r1 = tr.observe(1, BASE, now=0.0)
    assert tr.current is r1 and tr.stable is None
    assert (
        tr.observe(2, with_changes(BASE, lambda s: s["remediation"].update(dryRun=True)), now=10.0) is r1
    )  # remediation-only edit: same revision
    assert tr.tick(300.0) is None
    tr.note_wedge(400.0)
    assert tr.tick(900.0) is None  # only 500 s quiet since the wedge
    stable = tr.tick(1000.0)
    assert stable is not None and stable.stable and stable.stable_at == 1000.0
    assert tr.stable.hash == r1.hash
    assert tr.tick(2000.0) is None  # already stable


def test_reverting_reapplies_a_known_revision_keeping_its_stable_mark():
    tr = RevisionTracker(quiet_period_s=60)
    tr.observe(1, BASE, 0.0)
    tr.tick(100.0)
    bad = with_changes(BASE, lambda s: decode_env(s, "FOO", "512"))
    tr.observe(2, bad, 200.0)
    back = tr.observe(3, BASE, 300.0)
    assert back.stable and back.generation == 3 and back.applied_at == 300.0
    assert [r.generation for r in tr.revisions] == [2, 3]


def test_trim_keeps_the_stable_revision():
    tr = RevisionTracker(quiet_period_s=10, max_revisions=3)
    tr.observe(1, BASE, 0.0)
    tr.tick(20.0)
    stable_hash = tr.stable.hash
    for g in range(2, 10):
        tr.observe(g, with_changes(BASE, lambda s, g=g: s["prefill"].update(replicas=g)), 100.0 * g)
    assert len(tr.revisions) == 3
    assert tr.stable.hash == stable_hash
    assert tr.current.generation == 9


def test_tracker_round_trips_through_a_dict():
    tr = RevisionTracker(quiet_period_s=60)
    tr.observe(1, BASE, 0.0)
    tr.tick(100.0)
    tr.observe(2, with_changes(BASE, lambda s: decode_env(s, "FOO", "512")), 200.0)
    tr.note_wedge(250.0)
    tr.mark_rolled_back(tr.current.hash)
    again = RevisionTracker.from_dict(tr.to_dict())
    assert again.to_dict() == tr.to_dict()
    assert again.stable.hash == tr.stable.hash and again.rolled_back == tr.rolled_back


# --- correlation ------------------------------------------------------------------------------------


def incident_tracker():
    """Stable morning, a decode-only tuning change in the afternoon (the incident's shape)."""
    tr = RevisionTracker(quiet_period_s=600)
    tr.observe(4, BASE, now=0.0)
    tr.tick(8 * 3600.0)
    bad = with_changes(BASE, lambda s: decode_env(s, "FOO", "512"))
    tr.observe(5, bad, now=9 * 3600.0)
    return tr, bad


def test_wedge_soon_after_a_change_names_it():
    tr, _ = incident_tracker()
    suspect = correlate(9 * 3600.0 + 900.0, tr.revisions, within_s=3600)
    assert suspect is not None
    assert suspect.revision == tr.current.hash and suspect.generation == 5
    assert suspect.changes == ("decode.env FOO changed from 1 to 512",)
    assert suspect.seconds_after == 900.0 and suspect.stable_revision == tr.stable.hash
    assert suspect.changes_since_stable == suspect.changes
    assert "decode.env FOO changed from 1 to 512" in suspect.summary()
    assert "generation 5" in suspect.summary()
    assert suspect.to_dict()["changes"] == ["decode.env FOO changed from 1 to 512"]


def test_no_suspect_when_too_late_before_any_change_or_stable():
    tr, _ = incident_tracker()
    assert correlate(9 * 3600.0 + 7200.0, tr.revisions, within_s=3600) is None
    assert correlate(3600.0, tr.revisions) is None  # during the first (only) revision
    tr.tick(9 * 3600.0 + 700.0)  # the new revision proved itself
    assert correlate(9 * 3600.0 + 800.0, tr.revisions) is None


def test_two_changes_name_the_latest_and_diff_since_stable():
    tr, bad = incident_tracker()
    worse = with_changes(bad, lambda s: s["engine"].update(image="lmsysorg/sglang:v0.5.5"))
    tr.observe(6, worse, now=9 * 3600.0 + 60)
    suspect = correlate(9 * 3600.0 + 120, tr.revisions)
    assert suspect.changes == ("engine.image changed from lmsysorg/sglang:v0.5.4 to lmsysorg/sglang:v0.5.5",)
    assert len(suspect.changes_since_stable) == 2


# --- rollback ----------------------------------------------------------------------------------------


def test_rollback_modes():
    tr, bad = incident_tracker()
    suspect = correlate(9 * 3600.0 + 900.0, tr.revisions)
    off = decide_rollback("off", suspect, tr.stable, bad, tr.rolled_back)
    assert off.action == "none"
    hint = decide_rollback("suggest", suspect, tr.stable, bad, tr.rolled_back)
    assert hint.action == "suggest" and hint.to_revision == tr.stable.hash
    auto = decide_rollback("auto", suspect, tr.stable, bad, tr.rolled_back)
    # auto pins the stable revision (the children are built from it); the spec is not patched.
    assert auto.action == "pin" and (auto.from_revision, auto.to_revision) == (suspect.revision, tr.stable.hash)
    assert tr.stable.spec == {k: v for k, v in BASE.items() if k != "remediation"}
    with pytest.raises(ValueError):
        decide_rollback("sometimes", suspect, tr.stable, bad, tr.rolled_back)


def test_auto_rollback_at_most_once_per_bad_revision():
    tr, bad = incident_tracker()
    suspect = correlate(9 * 3600.0 + 900.0, tr.revisions)
    first = decide_rollback("auto", suspect, tr.stable, bad, tr.rolled_back)
    assert first.action == "pin"
    tr.mark_rolled_back(first.from_revision)
    tr.observe(5, revision_spec(tr, first.to_revision, bad), now=10 * 3600.0)  # the pin runs
    assert tr.current.hash == tr.stable.hash
    # Someone re-applies the bad spec; it wedges again: only a suggestion this time.
    tr.observe(7, bad, now=11 * 3600.0)
    suspect = correlate(11 * 3600.0 + 60, tr.revisions)
    second = decide_rollback("auto", suspect, tr.stable, bad, tr.rolled_back)
    assert second.action == "suggest" and "already rolled back" in second.message


def test_no_auto_rollback_when_spec_moved_on_or_no_stable():
    tr, bad = incident_tracker()
    suspect = correlate(9 * 3600.0 + 900.0, tr.revisions)
    newer = with_changes(bad, lambda s: s["prefill"].update(replicas=5))
    assert decide_rollback("auto", suspect, tr.stable, newer, set()).action == "suggest"
    assert decide_rollback("auto", suspect, None, bad, set()).action == "none"
    same = Revision(hash=suspect.revision, generation=5, applied_at=0.0, spec={}, stable=True)
    assert decide_rollback("auto", suspect, same, bad, set()).action == "none"
    assert decide_rollback("auto", None, tr.stable, bad, set()).action == "none"
