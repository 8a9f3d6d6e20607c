"""Evidence and change reports are read by the namespace's viewers (issue 27): credentials in env
are never spelled out, and an evidence ConfigMap cannot be rewritten after the fact."""

from dsv4_operator.watchdog.evidence import build_evidence_configmap
from dsv4_operator.watchdog.revisions import describe_change


def test_credential_env_values_are_redacted_and_tuning_values_kept():
    old = {
        "engine": {
            "env": [
                {"name": "HF_TOKEN", "value": "hf_old"},
                {"name": "SPLIT", "value": "256"},
                {"name": "DB", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
            ]
        }
    }
    new = {
        "engine": {
            "env": [
                {"name": "HF_TOKEN", "value": "hf_new"},
                {"name": "SPLIT", "value": "512"},
                {"name": "MY_API_KEY", "value": "sk-123"},
                {"name": "DB", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k2"}}},
            ]
        }
    }
    lines = describe_change(old, new)
    text = "\n".join(lines)
    assert "hf_old" not in text and "hf_new" not in text and "sk-123" not in text, text
    assert "engine.env HF_TOKEN changed from <redacted> to <redacted>" in lines
    assert "engine.env MY_API_KEY added (=<redacted>)" in lines
    assert "engine.env SPLIT changed from 256 to 512" in lines  # what the incident needed
    assert any(line.startswith("engine.env DB changed") and "k2" in line for line in lines)  # a reference, not a value


def test_evidence_configmaps_are_immutable():
    cm = build_evidence_configmap(
        deployment="d",
        namespace="n",
        pod="d-prefill-0",
        role="prefill",
        captured_at=1.7e9,
        verdict={"state": "Wedged", "reason": "stuck_inflight"},
    )
    assert cm["immutable"] is True
