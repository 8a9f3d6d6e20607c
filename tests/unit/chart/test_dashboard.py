"""The chart's Grafana dashboard (files/grafana-dashboard.json, shipped in a ConfigMap): every
metric it queries exists, and every engine, router and operator metric has a panel. The names come
from the code that registers them (dsv4_engine.metrics, dsv4_router's RouterMetrics and
TenantMetrics, dsv4_operator.telemetry), so a metric added there without a panel, or a panel left
behind by a rename, fails here."""

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
# A metric name in PromQL: dsv4:... (engine), dsv4_router:... (router) or dsv4_operator_...
# (operator), before any selector, range or bracket.
METRIC_IN_QUERY = re.compile(r"\b(dsv4:[a-zA-Z0-9_:]+|dsv4_router:[a-zA-Z0-9_:]+|dsv4_operator_[a-zA-Z0-9_]+)")
SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("_sum", "_count", ""),
}


def engine_series() -> dict[str, set[str]]:
    """Family -> the series names Prometheus stores for it."""
    out: dict[str, set[str]] = {}
    for name in engine_metrics.GAUGES:
        out[f"dsv4:{name}"] = {f"dsv4:{name}"}
    for name in engine_metrics.COUNTERS:
        out[f"dsv4:{name}"] = {f"dsv4:{name}_total"}
    for name in engine_metrics.RANK_GAUGES:  # --dp-size N, per attention rank
        out[f"dsv4:{name}"] = {f"dsv4:{name}"}
    for name in engine_metrics.RANK_COUNTERS:
        out[f"dsv4:{name}"] = {f"dsv4:{name}_total"}
    for name in engine_metrics.LAYER_GAUGES:  # MoE expert loads (docs/eplb.md)
        out[f"dsv4:{name}"] = {f"dsv4:{name}"}
    for name in (*engine_metrics.LAYER_COUNTERS, *engine_metrics.EXPERT_COUNTERS):
        out[f"dsv4:{name}"] = {f"dsv4:{name}_total"}
    for name in (*engine_metrics.HISTOGRAMS, *engine_metrics.COUNT_HISTOGRAMS):
        out[f"dsv4:{name}"] = {f"dsv4:{name}_{s}" for s in ("bucket", "sum", "count")}
    return out


def registry_series(registry) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for family in registry.collect():  # labelled families have no samples yet
        out[family.name] = {family.name + s for s in SUFFIXES[family.type]}
    return out


def operator_series() -> dict[str, set[str]]:
    return registry_series(OperatorMetrics().registry)


def router_series() -> dict[str, set[str]]:
    from dsv4_router.tenancy import TenantMetrics
    from dsv4_router.workers import RouterMetrics

    metrics = RouterMetrics()
    TenantMetrics(metrics.registry)
    return registry_series(metrics.registry)


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
    known = set().union(*engine_series().values(), *router_series().values(), *operator_series().values())
    used = {m for q in queries(dashboard) for m in METRIC_IN_QUERY.findall(q)}
    assert used, "no metric queries found"
    assert not used - known, f"the dashboard queries metrics nobody exports: {sorted(used - known)}"


def test_every_metric_has_a_panel(dashboard: dict) -> None:
    used = {m for q in queries(dashboard) for m in METRIC_IN_QUERY.findall(q)}
    for family, series in {**engine_series(), **router_series(), **operator_series()}.items():
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


# ---- alert rules (templates/prometheusrule.yaml) ----------------------------------------------------


def alert_rules(values: dict | None = None) -> dict[str, dict]:
    docs = helm_template({"alerts.enabled": True, **(values or {})})
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    return {r["alert"]: r for group in rule["spec"]["groups"] for r in group["rules"]}


def test_alerts_are_off_by_default_and_cover_the_failures_users_page_on() -> None:
    assert not [d for d in helm_template() if d["kind"] == "PrometheusRule"]
    rules = alert_rules()
    assert set(rules) == {
        "DSV4PodWedged",
        "DSV4HandoffStalled",
        "DSV4RemediationBudgetSpent",
        "DSV4TransferFailures",
        "DSV4KVCacheFull",
        "DSV4Router5xx",
        "DSV4Router429",
    }
    for name, rule in rules.items():
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name
    assert "> 0.9" in alert_rules({"alerts.kvFullRatio": 0.9})["DSV4KVCacheFull"]["expr"]


def test_every_metric_an_alert_reads_exists() -> None:
    known = set().union(*engine_series().values(), *router_series().values(), *operator_series().values())
    used = {m for rule in alert_rules().values() for m in METRIC_IN_QUERY.findall(rule["expr"])}
    assert {"dsv4_operator_wedged_pods", "dsv4_router:rejected_total", "dsv4:kv_pages_free"} <= used
    assert not used - known, f"alerts read metrics nobody exports: {sorted(used - known)}"


def test_the_budget_alert_matches_what_the_executor_records() -> None:
    """`remediations_total{action="held", result=REASON}`: the hold reasons the alert names exist."""
    from dsv4_operator.watchdog.policy import HOLD_BUDGET, HOLD_RATE_LIMIT

    expr = alert_rules()["DSV4RemediationBudgetSpent"]["expr"]
    assert f'result=~"{HOLD_BUDGET}|{HOLD_RATE_LIMIT}"' in expr and 'action="held"' in expr


# The fields of prometheus-operator's PrometheusRule (monitoring.coreos.com/v1) the chart writes.
PROMETHEUS_RULE_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PrometheusRule"},
        "metadata": {"type": "object", "required": ["name", "namespace"]},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "groups": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["name", "rules"],
                        "properties": {
                            "name": {"type": "string"},
                            "rules": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "required": ["alert", "expr"],
                                    "properties": {
                                        "alert": {"type": "string", "pattern": "^[A-Za-z][A-Za-z0-9]*$"},
                                        "expr": {"type": "string"},
                                        "for": {"type": "string", "pattern": "^([0-9]+(ms|s|m|h|d|w|y))+$"},
                                        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                                        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
                                    },
                                },
                            },
                        },
                    },
                }
            },
        },
    },
}


def test_the_rule_is_well_formed_and_its_templates_reach_prometheus() -> None:
    import jsonschema

    from chart_testutil import CHART, run_helm

    (rule,) = [
        d
        for d in helm_template({"alerts.enabled": True, "alerts.labels": {"release": "kps"}})
        if d["kind"] == "PrometheusRule"
    ]
    jsonschema.validate(rule, PROMETHEUS_RULE_SCHEMA)
    assert rule["metadata"]["labels"]["release"] == "kps"
    for r in (r for g in rule["spec"]["groups"] for r in g["rules"]):
        assert r["expr"].count("(") == r["expr"].count(")"), r["alert"]
    # Prometheus' own templating, escaped through helm's: it must arrive as {{ $labels.x }}.
    assert "{{ $labels.namespace }}" in alert_rules()["DSV4PodWedged"]["annotations"]["summary"]
    lint = run_helm("lint", "--strict", str(CHART), "--set", "alerts.enabled=true", check=False)
    assert lint.returncode == 0, lint.stdout + lint.stderr
