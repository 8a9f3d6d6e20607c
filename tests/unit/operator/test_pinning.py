"""The rollback pin (dsv4_operator.pinning): which stored revision the children run instead of the
spec, and when the pin stops applying."""

import json

from dsv4_operator.pinning import pin_value, pinned_revision, pinned_spec, revision_spec
from dsv4_operator.watchdog.revisions import RevisionTracker, spec_hash
from dsv4_wire import ANNOTATION_PINNED_REVISION, ANNOTATION_REVISIONS

GOOD = {"model": {"name": "m", "path": "/models/m"}, "engine": {"image": "reg/dsv4:1"}}
BAD = {**GOOD, "engine": {"image": "reg/dsv4:bad"}, "remediation": {"rollback": "auto", "dryRun": True}}


def annotations(pin: str) -> dict[str, str]:
    tracker = RevisionTracker()
    tracker.observe(1, GOOD, now=1.0)
    tracker.observe(2, BAD, now=2.0)
    return {ANNOTATION_REVISIONS: json.dumps(tracker.to_dict()), ANNOTATION_PINNED_REVISION: pin}


def test_a_pin_applies_at_its_generation_only() -> None:
    good = spec_hash(GOOD)
    assert pin_value(good, 2) == f"{good}@2"
    assert pinned_revision(annotations(pin_value(good, 2)), 2) == good
    assert pinned_revision(annotations(pin_value(good, 2)), 3) is None  # the user edited the spec since
    for broken in ("", "@2", f"{good}@", f"{good}@two", good):
        assert pinned_revision(annotations(broken), 2) is None, broken
    assert pinned_revision(None, 2) is None


def test_the_pinned_spec_is_the_stored_revision_with_the_current_remediation() -> None:
    good = spec_hash(GOOD)
    spec, revision = pinned_spec(annotations(pin_value(good, 2)), 2, BAD)
    assert revision == good
    assert spec == {**GOOD, "remediation": BAD["remediation"]}  # how it heals stays as written
    assert spec_hash(spec) == good


def test_a_pin_to_a_revision_the_history_lacks_or_cannot_read_is_ignored() -> None:
    assert pinned_spec(annotations(pin_value("0" * 16, 2)), 2, BAD) == (None, None)
    unreadable = {**annotations(pin_value(spec_hash(GOOD), 2)), ANNOTATION_REVISIONS: "{not json"}
    assert pinned_spec(unreadable, 2, BAD) == (None, None)
    assert revision_spec(RevisionTracker(), spec_hash(GOOD), BAD) is None
