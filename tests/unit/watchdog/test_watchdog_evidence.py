"""The evidence ConfigMap body: labels, names, content, and the 1 MiB limit."""

import json
import re

from dsv4_operator.watchdog.detector import Wedged, verdict_to_dict
from dsv4_operator.watchdog.evidence import (
    DEFAULT_DATA_BUDGET,
    EVIDENCE_LABEL,
    build_evidence_configmap,
    evidence_name,
    split_budget,
    truncate_utf8,
)

NOW = 1_795_000_000.0  # 2026-11-18T...
VERDICT = verdict_to_dict(Wedged("stuck_inflight", {"stuck_seconds": 130.0, "pending": 1}))
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def build(**kw):
    args = dict(
        deployment="dsv4-flash",
        namespace="serving",
        pod="dsv4-flash-prefill-0",
        role="prefill",
        captured_at=NOW,
        verdict=VERDICT,
    )
    args.update(kw)
    return build_evidence_configmap(**args)


def encoded_size(obj) -> int:
    return len(json.dumps(obj).encode())


def test_small_evidence_kept_whole():
    cm = build(
        stacks="Thread 1:\n  File scheduler.py, line 10, in loop\n",
        loads={"role": "prefill", "queues": {"inflight": 1}},
        metrics="dsv4:num_prefill_inflight_queue_reqs 1\n",
        logs=["line 1", "line 2"],
        spec_diff=["decode.env FOO changed from 1 to 512"],
        revision="abc123",
        owner_references=[
            {"apiVersion": "serving.dsv4.dev/v1alpha1", "kind": "DSV4Deployment", "name": "x", "uid": "u1"}
        ],
    )
    assert cm["apiVersion"] == "v1" and cm["kind"] == "ConfigMap"
    md = cm["metadata"]
    assert md["labels"][EVIDENCE_LABEL] == "true"
    assert md["labels"]["serving.dsv4.dev/pod"] == "dsv4-flash-prefill-0"
    assert md["labels"]["serving.dsv4.dev/role"] == "prefill"
    assert md["namespace"] == "serving"
    assert md["annotations"]["serving.dsv4.dev/reason"] == "stuck_inflight"
    assert md["annotations"]["serving.dsv4.dev/revision"] == "abc123"
    assert md["annotations"]["serving.dsv4.dev/truncated"] == ""
    assert md["ownerReferences"][0]["kind"] == "DSV4Deployment"
    data = cm["data"]
    assert set(data) == {
        "verdict.json",
        "spec-diff.txt",
        "loads.json",
        "timelines.json",
        "stacks.txt",
        "logs.txt",
        "metrics.txt",
    }
    assert json.loads(data["verdict.json"])["details"]["stuck_seconds"] == 130.0
    assert json.loads(data["loads.json"])["queues"]["inflight"] == 1
    assert data["logs.txt"] == "line 1\nline 2\n"
    assert data["spec-diff.txt"] == "decode.env FOO changed from 1 to 512\n"
    assert data["stacks.txt"].startswith("Thread 1:")
    assert all(isinstance(v, str) for v in data.values())
    assert all(re.match(r"^[-._a-zA-Z0-9]+$", k) for k in data)


def test_missing_pieces_say_so():
    cm = build()
    assert cm["data"]["stacks.txt"] == "(not captured: stacks unavailable)\n"
    assert cm["data"]["logs.txt"].startswith("(not captured")


def test_huge_evidence_fits_one_configmap():
    logs = [f"{i:08d} INFO scheduler: step ok" for i in range(200_000)]  # ~6 MB
    stacks = "".join(f'Thread {i}:\n  File "x.py", line {i}, in f\n' for i in range(100_000))
    metrics = "".join(f'dsv4:kv_transfer_latency_seconds_bucket{{le="{i}"}} {i}\n' for i in range(100_000))
    cm = build(stacks=stacks, logs=logs, metrics=metrics, loads={"q": list(range(1000))}, spec_diff=["x changed"])
    assert encoded_size(cm) < 1024 * 1024
    data = cm["data"]
    assert sum(len(v.encode()) for v in data.values()) <= DEFAULT_DATA_BUDGET
    # Logs keep their end (the moments before the wedge), stacks and metrics their start.
    assert data["logs.txt"].rstrip().endswith("00199999 INFO scheduler: step ok")
    assert "bytes truncated" in data["logs.txt"].splitlines()[0]
    assert data["stacks.txt"].startswith("Thread 0:")
    assert data["stacks.txt"].rstrip().endswith("bytes truncated ...]")
    assert data["metrics.txt"].startswith('dsv4:kv_transfer_latency_seconds_bucket{le="0"}')
    # Small fields are whole; big ones share the rest by weight (stacks = logs > metrics).
    assert json.loads(data["loads.json"]) == {"q": list(range(1000))}
    assert len(data["stacks.txt"].encode()) > len(data["metrics.txt"].encode())
    assert abs(len(data["stacks.txt"].encode()) - len(data["logs.txt"].encode())) < 1024
    truncated = cm["metadata"]["annotations"]["serving.dsv4.dev/truncated"].split(",")
    assert sorted(truncated) == ["logs.txt", "metrics.txt", "stacks.txt"]


def test_truncate_utf8_boundaries():
    text = "é" * 1000  # 2 bytes each
    for keep in ("head", "tail", "both"):
        out = truncate_utf8(text, 301, keep)
        assert len(out.encode()) <= 301
        out.encode().decode("utf-8")  # still valid
        assert "bytes truncated" in out
    assert truncate_utf8("short", 100) == "short"
    assert len(truncate_utf8("x" * 100, 5).encode()) <= 5  # no room for the marker


def test_split_budget_water_filling():
    limits = split_budget({"a": 10, "b": 1000, "c": 1000}, {"a": 1, "b": 1, "c": 3}, 410)
    assert limits["a"] == 10
    assert limits["b"] == 100 and limits["c"] == 300
    assert sum(limits.values()) <= 410
    assert split_budget({"a": 5, "b": 6}, {}, 100) == {"a": 5, "b": 6}


def test_names_and_labels_are_valid_kubernetes_values():
    long_pod = "My_Deployment.with-a-very-long-name-that-goes-on-and-on-prefill-12"
    cm = build(deployment="A" * 300, pod=long_pod)
    name = cm["metadata"]["name"]
    assert DNS_SUBDOMAIN.match(name) and len(name) <= 253
    for value in cm["metadata"]["labels"].values():
        assert LABEL_VALUE.match(value) and len(value) <= 63
    assert cm["metadata"]["annotations"]["serving.dsv4.dev/pod"] == long_pod
    assert evidence_name("d", "p-0", NOW) != evidence_name("d", "p-0", NOW + 1)
    assert evidence_name("d", "p-0", NOW).startswith("d-evidence-p-0-")
    # Pods of one StatefulSet differ only at the end of their names.
    assert evidence_name("dsv4", "dsv4-flash-prefill-0", NOW) != evidence_name("dsv4", "dsv4-flash-prefill-1", NOW)


def test_the_stuck_requests_timelines_get_their_own_field():
    stuck = {
        "rid": "r1",
        "state": "Transferring",
        "last_progress_seconds_ago": 130.0,
        "events": [
            {"event": "arrival", "seconds_ago": 131.0, "at": NOW - 131},
            {"event": "Transferring", "seconds_ago": 130.0, "at": NOW - 130},
        ],
    }
    data = build(loads={"queues": {"inflight": 1}, "requests": [stuck]})["data"]
    assert json.loads(data["timelines.json"]) == [stuck]
    assert json.loads(data["loads.json"])["requests"] == [stuck]
    # an engine without timelines (SGLang, or no answer) says so
    assert data["timelines.json"] != build(loads={"queues": {}})["data"]["timelines.json"]
    assert build(loads={"queues": {}})["data"]["timelines.json"].startswith("(not captured")
