"""The chart's Grafana dashboard (files/grafana-dashboard.json, shipped in a ConfigMap): every
metric it queries exists, and every engine and operator metric has a panel. The names come from
the code that registers them (dsv4_engine.metrics, dsv4_operator.telemetry), so a metric added
there without a panel, or a panel left behind by a rename, fails here."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: chart_testutil

from chart_testutil import CHART, helm_template, one  # noqa: E402
from dsv4_engine import metrics as engine_metrics  # noqa: E402
from dsv4_operator.telemetry import OperatorMetrics  # noqa: E402

DASHBOARD = CHART / "files" / "grafana-dashboard.json"
# A metric name in PromQL: dsv4:... (engine) or dsv4_operator_... (operator), before any
# selector, range or bracket.
METRIC_IN_QUERY = re.compile(r"\b(dsv4:[a-zA-Z0-9_:]+|dsv4_operator_[a-zA-Z0-9_]+)")


def engine_series() -> dict[str, set[str]]:
    """Family -> the series names Prometheus stores for it."""
    out: dict[str, set[str]] = {}
    for name in engine_metrics.GAUGES:
        out[f"dsv4:{name}"] = {f"dsv4:{name}"}
    for name in engine_metrics.COUNTERS:
        out[f"dsv4:{name}"] = {f"dsv4:{name}_total"}
    for name in (*engine_metrics.HISTOGRAMS, *engine_metrics.COUNT_HISTOGRAMS):
        out[f"dsv4:{name}"] = {f"dsv4:{name}_{s}" for s in ("bucket", "sum", "count")}
    return out


def operator_series() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    suffixes = {
        "counter": ("_total",),
        "gauge": ("",),
        "histogram": ("_bucket", "_sum", "_count"),
        "summary": ("_sum", "_count", ""),
    }
    for family in OperatorMetrics().registry.collect():  # labelled families have no samples yet
        out[family.name] = {family.name + s for s in suffixes[family.type]}
    return out


def queries(dashboard: dict) -> list[str]:
    found = []

    def walk(panels: list[dict]) -> None:
        for p in panels:
            found.extend(t["expr"] for t in p.get("targets", []))
            walk(p.get("panels", []))

    walk(dashboard["panels"])
    found.extend(v["query"]["query"] for v in dashboard["templating"]["list"] if v.get("type") == "query")
    return found


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_every_queried_metric_exists(dashboard: dict) -> None:
    known = set().union(*engine_series().values(), *operator_series().values())
    used = {m for q in queries(dashboard) for m in METRIC_IN_QUERY.findall(q)}
    assert used, "no metric queries found"
    assert not used - known, f"the dashboard queries metrics nobody exports: {sorted(used - known)}"


def test_every_metric_has_a_panel(dashboard: dict) -> None:
    used = {m for q in queries(dashboard) for m in METRIC_IN_QUERY.findall(q)}
    for family, series in {**engine_series(), **operator_series()}.items():
        assert series & used, f"no panel shows {family}"


def test_panels_are_well_formed(dashboard: dict) -> None:
    ids = []
    for p in dashboard["panels"]:
        ids.append(p["id"])
        grid = p["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, p["title"]
        if p["type"] != "row":
            assert p["targets"] and p["datasource"]["uid"] == "${datasource}", p["title"]
            assert len({t["refId"] for t in p["targets"]}) == len(p["targets"])
    assert len(ids) == len(set(ids))
    assert dashboard["uid"] and dashboard["title"]
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    for q in queries(dashboard):
        for var in re.findall(r"\$([a-z_]+)", q):
            assert var in variables, f"undefined variable ${var} in {q}"


def test_the_configmap_carries_the_dashboard_as_is() -> None:
    cm = one(helm_template({"grafanaDashboard.enabled": True}), "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["dsv4.json"]) == json.loads(DASHBOARD.read_text())
    other = one(
        helm_template(
            {
                "grafanaDashboard.enabled": True,
                "grafanaDashboard.namespace": "monitoring",
                "grafanaDashboard.labels": {"dashboards": "dsv4"},
            }
        ),
        "ConfigMap",
    )
    assert other["metadata"]["namespace"] == "monitoring" and other["metadata"]["labels"]["dashboards"] == "dsv4"
