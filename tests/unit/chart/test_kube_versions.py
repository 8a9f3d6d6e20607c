"""The chart renders on every Kubernetes version it claims (issue 43): `helm template
--kube-version` for the oldest version Chart.yaml's kubeVersion allows and the newest
kubernetes-validate knows, each render validated strictly against that version's schemas. The
tenant policy follows the cluster: ValidatingAdmissionPolicy v1 from 1.30, v1beta1 on 1.29 only
where the cluster serves it, none otherwise (the operator enforces it at reconcile anyway)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: chart_testutil

from chart_testutil import CHART, by_kind, helm_template  # noqa: E402

VAP = "ValidatingAdmissionPolicy"
VAP_BETA = f"admissionregistration.k8s.io/v1beta1/{VAP}"
# Kinds no Kubernetes release defines (checked against their own schemas in test_chart.py).
NOT_BUILT_IN = {"DSV4Deployment", "ServiceMonitor", "PrometheusRule"}
ALL_ON = {
    "metrics.serviceMonitor.enabled": True,
    "grafanaDashboard.enabled": True,
    "sample.enabled": True,
    "alerts.enabled": True,
}


def oldest() -> str:
    claim = yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"]
    major, minor = re.fullmatch(r">=\s*(\d+)\.(\d+)\.\d+(-0)?", claim).group(1, 2)
    return f"{major}.{minor}.0"


NEWEST = kubernetes_validate.latest_version()


def validate_all(docs: list[dict], version: str) -> None:
    for doc in docs:
        if doc["kind"] not in NOT_BUILT_IN:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{version}: {doc['kind']}/{doc['metadata'].get('name')}: {e}")


def test_the_claimed_range_starts_at_1_29() -> None:
    assert oldest() == "1.29.0"


@pytest.mark.parametrize("values", [{}, ALL_ON], ids=["defaults", "all-on"])
def test_the_oldest_claimed_version_gets_no_v1_admission_policy(values: dict) -> None:
    docs = helm_template(values, kube_version=oldest(), include_crds=True)
    assert not by_kind(docs, VAP) and not by_kind(docs, f"{VAP}Binding")
    validate_all(docs, oldest())


def test_the_oldest_gets_v1beta1_where_the_cluster_serves_it() -> None:
    docs = helm_template(kube_version=oldest(), api_versions=(VAP_BETA,))
    policies = by_kind(docs, VAP) + by_kind(docs, f"{VAP}Binding")
    assert [d["apiVersion"] for d in policies] == ["admissionregistration.k8s.io/v1beta1"] * 2
    validate_all(docs, oldest())


@pytest.mark.parametrize("version", ["1.30.0", NEWEST])
def test_1_30_and_the_newest_get_v1(version: str) -> None:
    docs = helm_template(ALL_ON, kube_version=version, include_crds=True)
    policies = by_kind(docs, VAP) + by_kind(docs, f"{VAP}Binding")
    assert [d["apiVersion"] for d in policies] == ["admissionregistration.k8s.io/v1"] * 2
    validate_all(docs, version)
