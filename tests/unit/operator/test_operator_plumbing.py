"""The operator's small pure pieces: where credentials come from, API paths, health verdicts,
spec checking messages."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
import yaml

from dsv4_operator import kube
from dsv4_operator.handlers import apply as handlers
from dsv4_operator.main import make_settings
from dsv4_operator.telemetry import HealthState, OperatorMetrics, health_verdict


@pytest.mark.parametrize(
    "env,in_cluster,home,expected",
    [
        ("/k/config", True, True, "kubeconfig"),  # an explicit KUBECONFIG wins, even in a pod
        (None, True, True, "in-cluster"),  # then the pod's service account
        (None, False, True, "kubeconfig"),  # then ~/.kube/config
        (None, False, False, None),
        ("", True, False, "in-cluster"),
    ],
)
def test_login_source_order(env, in_cluster, home, expected) -> None:
    assert kube.choose_login_source(env, in_cluster, home) == expected


async def test_kubeconfig_becomes_kopf_connection_info(tmp_path: Path) -> None:
    ca = tmp_path / "ca.crt"
    ca.write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    cfg_path = tmp_path / "config"
    cfg_path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "c",
                "clusters": [
                    {"name": "k", "cluster": {"server": "https://10.0.0.1:6443", "certificate-authority": str(ca)}}
                ],
                "users": [{"name": "u", "user": {"token": "s3cret"}}],
                "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
            }
        )
    )
    cfg = await kube.load_configuration(str(cfg_path))
    info = await kube.connection_info(cfg)
    assert info.server == "https://10.0.0.1:6443"
    assert info.token == "s3cret" and info.scheme == "Bearer"
    assert Path(info.ca_path).read_text() == ca.read_text()
    assert info.insecure is False


async def test_client_certificate_kubeconfig(tmp_path: Path) -> None:
    data = base64.b64encode(b"-----BEGIN X-----\nAA\n-----END X-----\n").decode()
    cfg_path = tmp_path / "config"
    cfg_path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "c",
                "clusters": [{"name": "k", "cluster": {"server": "https://k:6443", "insecure-skip-tls-verify": True}}],
                "users": [{"name": "u", "user": {"client-certificate-data": data, "client-key-data": data}}],
                "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
            }
        )
    )
    info = await kube.connection_info(await kube.load_configuration(str(cfg_path)))
    assert info.token is None and info.insecure is True
    assert Path(info.certificate_path).read_bytes() == base64.b64decode(data)


def test_resource_paths() -> None:
    assert kube.resource_path("v1", "services", "ns", "a") == "/api/v1/namespaces/ns/services/a"
    assert kube.resource_path("apps/v1", "statefulsets", "ns") == "/apis/apps/v1/namespaces/ns/statefulsets"
    cr = {
        "apiVersion": "serving.dsv4.dev/v1alpha1",
        "kind": "DSV4Deployment",
        "metadata": {"name": "f", "namespace": "n"},
    }
    assert kube.path_of(cr, "status") == "/apis/serving.dsv4.dev/v1alpha1/namespaces/n/dsv4deployments/f/status"


def test_which_api_errors_are_retried() -> None:
    assert kube.ApiError(503, "ServiceUnavailable", "").transient
    assert kube.ApiError(0, "ConnectionError", "").transient
    assert kube.ApiError(409, "Conflict", "").transient
    assert not kube.ApiError(422, "Invalid", "").transient
    assert not kube.ApiError(400, "BadRequest", "").transient


def test_health_verdicts() -> None:
    state = HealthState()
    assert health_verdict(state) == (False, "starting")
    state.started_at = 1.0
    assert health_verdict(state) == (True, "ok")
    state.failure = "boom"
    assert health_verdict(state) == (False, "failed: boom")
    assert health_verdict(HealthState(started_at=1.0, stopped_at=2.0)) == (False, "stopped")


def test_metrics_are_in_their_own_registry() -> None:
    a, b = OperatorMetrics(), OperatorMetrics()
    a.reconciles.labels("applied").inc()
    assert b'dsv4_operator_reconciles_total{result="applied"} 1.0' in a.render()
    assert b'result="applied"' not in b.render()


def test_spec_problems_are_one_readable_line() -> None:
    spec, problem = handlers.check_spec(
        "flash", {"model": {"name": "m", "path": "/m"}, "engine": {"image": "i"}, "prefill": {"replicas": -1}}
    )
    assert spec is None
    assert problem == "spec.prefill.replicas: Input should be greater than or equal to 0"
    spec, problem = handlers.check_spec("x" * 60, {"model": {"name": "m", "path": "/m"}, "engine": {"image": "i"}})
    assert spec is None and "too long" in problem
    spec, problem = handlers.check_spec("flash", {"model": {"name": "m", "path": "/m"}, "engine": {"image": "i"}})
    assert spec is not None and problem is None


def test_each_replica_reports_as_itself(monkeypatch) -> None:
    monkeypatch.setenv("POD_NAME", "dsv4-operator-7d9f-abcde")
    assert make_settings(standalone=False).posting.reporting_instance == "dsv4-operator-7d9f-abcde"
    monkeypatch.delenv("POD_NAME")
    assert make_settings(standalone=False).posting.reporting_instance not in ("", "dev")


def test_operator_settings() -> None:
    s = make_settings(standalone=True)
    assert s.peering.standalone is True and s.scanning.disabled is True
    ours = "app.kubernetes.io/name=dsv4,app.kubernetes.io/managed-by=dsv4-operator"
    assert list(s.watching.label_selectors.values()) == [ours] * 2 + [ours] * 6 + [
        "app.kubernetes.io/name=dsv4,serving.dsv4.dev/role in (prefill,decode,router)"
    ]  # the watchdog's pod watch


async def test_in_cluster_service_account_login(tmp_path: Path) -> None:
    sa = tmp_path / "serviceaccount"
    sa.mkdir()
    (sa / "token").write_text("pod-token\n")
    (sa / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    info = await kube.connection_info(await kube.load_configuration(env=env, sa_dir=sa, home=tmp_path / "none"))
    assert info.server == "https://10.96.0.1:443"
    assert info.token == "pod-token" and info.ca_path == str(sa / "ca.crt")
    # A KUBECONFIG in the environment still wins over the pod's identity.
    assert kube.choose_login_source("/x", kube.in_cluster_available(env, sa), False) == "kubeconfig"


async def test_no_credentials_is_a_login_error(tmp_path: Path) -> None:
    import kopf

    with pytest.raises(kopf.LoginError):
        await kube.load_configuration(env={}, sa_dir=tmp_path, home=tmp_path / "none")


def test_drift_worth_reapplying() -> None:
    """Deleted: always. Changed: workloads only when their generation moved (their status changes
    all the time), other children on every change. Added: never (the reconcile applies). Listed:
    as changed."""
    from dsv4_operator.handlers.children import drift_worth_reapplying as drift

    assert drift("DELETED", "Service", None, None) and drift("DELETED", "StatefulSet", 3, 3)
    assert drift("MODIFIED", "Service", None, None) and drift("MODIFIED", "Role", 1, 1)
    assert drift("MODIFIED", "StatefulSet", 4, 3) and not drift("MODIFIED", "StatefulSet", 3, 3)
    assert not drift("MODIFIED", "Deployment", 2, None)  # first sight after a restart
    assert not drift("ADDED", "Service", 1, None) and not drift(None, "StatefulSet", 1, None)
    # A listing (kopf relists after 410 Gone): a child edited while no watch was open.
    assert drift(None, "Role", 1, None) and drift(None, "StatefulSet", 4, 3) and not drift(None, "StatefulSet", 3, 3)


def test_the_first_log_line_says_where_the_operator_reads() -> None:
    from dsv4_operator.main import scope_line

    assert "every namespace" in scope_line([])
    line = scope_line(["dsv4-system", "llm"])
    assert "dsv4-system, llm only" in line and "WATCHED-BY" in line
