"""The Helm chart charts/dsv4-operator, checked offline with a real helm (v4) binary.

- `helm lint --strict` passes for the default values and with every option on;
- `helm template` for each values variant renders objects that kubernetes-validate accepts in
  strict mode (unknown fields rejected), a DSV4Deployment the CRD's schema accepts, and
  ServiceMonitors with the fields prometheus-operator reads;
- the operator Deployment is hardened (non-root, read-only root, no privilege escalation,
  probes, requests) and runs two replicas with leader election (rolling update that keeps one
  running, spread over nodes, a PodDisruptionBudget), or one standalone replica on request;
- RBAC: a ClusterRole for scope cluster, a Role per watched namespace otherwise, no wildcards;
- values.schema.json rejects bad values with a message naming the value;
- the chart's CRD is the top-level crds/dsv4deployment.yaml (a symlink, checked byte for byte).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: chart_testutil

from chart_testutil import (  # noqa: E402
    CHART,
    CRD_FILE,
    NAMESPACE,
    RELEASE,
    REPO,
    HelmError,
    by_kind,
    grants,
    helm_notes,
    helm_template,
    one,
    rbac_rules,
    require_tool,
    run_helm,
)
from dsv4_operator import manifests  # noqa: E402
from dsv4_operator.crd import crd_jsonschema  # noqa: E402
from dsv4_operator.spec import parse_spec  # noqa: E402

K8S_VERSIONS = ("1.33.0", kubernetes_validate.latest_version())
STANDALONE = {"leaderElection.enabled": False, "replicaCount": 1}
ALL_ON = {"metrics.serviceMonitor.enabled": True, "grafanaDashboard.enabled": True, "sample.enabled": True}
VARIANTS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "cluster-everything-on": ALL_ON,
    "namespaced-release-ns": {"watch.scope": "namespaces"},
    "namespaced-two-ns-servicemonitor": {
        "watch.scope": "namespaces",
        "watch.namespaces": ["team-a", NAMESPACE],
        "metrics.serviceMonitor.enabled": True,
        "sample.enabled": True,
    },
    "servicemonitor-operator-only": {"metrics.serviceMonitor.enabled": True, "metrics.serviceMonitor.engines": False},
    "minimal": {
        "metrics.service.enabled": False,
        "rbac.create": False,
        "serviceAccount.create": False,
        "serviceAccount.name": "existing-sa",
        "tenantPolicy.admissionPolicy": False,
        "operatorKey.existingSecret": "existing-key",
    },
    "pinned-image-and-scheduling": {
        "image.repository": "registry.example/dsv4-operator",
        "image.tag": "0.1.0-rc1",
        "imagePullSecrets": [{"name": "regcred"}],
        "priorityClassName": "system-cluster-critical",
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "tolerations": [{"key": "ops", "operator": "Exists", "effect": "NoSchedule"}],
        "operator.extraArgs": ["--verbose"],
    },
    "standalone": STANDALONE,
    "three-replicas-own-affinity-rate-limit": {
        "replicaCount": 3,
        "operator.restartRateLimit": "4/300",
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [{"matchExpressions": [{"key": "ops", "operator": "In", "values": ["true"]}]}]
                }
            }
        },
    },
}

# The ServiceMonitor fields the chart sets, as prometheus-operator's monitoring.coreos.com/v1 API
# defines them (no schema of that CRD ships offline): anything else would be pruned or rejected.
SERVICE_MONITOR_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object", "required": ["name", "namespace"]},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "endpoints"],
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"matchLabels": {"type": "object", "additionalProperties": {"type": "string"}}},
                },
                "namespaceSelector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "any": {"type": "boolean"},
                        "matchNames": {"type": "array", "items": {"type": "string"}},
                    },
                },
                "targetLabels": {"type": "array", "items": {"type": "string"}},
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["port"],
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "honorLabels": {"type": "boolean"},
                            "interval": {"type": "string", "pattern": "^([0-9]+(ms|s|m|h))+$"},
                            "scrapeTimeout": {"type": "string", "pattern": "^([0-9]+(ms|s|m|h))+$"},
                        },
                    },
                },
            },
        },
    },
}


def validate_doc(doc: dict[str, Any]) -> None:
    kind = doc["kind"]
    if kind == "DSV4Deployment":
        jsonschema.validate(doc, crd_jsonschema(yaml.safe_load(CRD_FILE.read_text())))
    elif kind == "ServiceMonitor":
        jsonschema.validate(doc, SERVICE_MONITOR_SCHEMA)
    else:
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


def operator_deployment(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return one(docs, "Deployment")


def operator_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    containers = operator_deployment(docs)["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["operator"]
    return containers[0]


# ---- lint and render -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "values", [{}, ALL_ON, {"watch.scope": "namespaces", **ALL_ON}], ids=["defaults", "all-on", "namespaced-all-on"]
)
def test_helm_lint_strict(values: dict[str, Any]) -> None:
    args = [a for k, v in values.items() for a in ("--set-json", f"{k}={json.dumps(v)}")]
    proc = run_helm("lint", "--strict", str(CHART), "--namespace", NAMESPACE, *args, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_rendered_objects_validate(variant: str) -> None:
    docs = helm_template(VARIANTS[variant], include_crds=True)
    kinds = {d["kind"] for d in docs}
    assert {"CustomResourceDefinition", "Deployment"} <= kinds
    for doc in docs:
        try:
            validate_doc(doc)
        except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as e:
            pytest.fail(f"{variant}: {doc['kind']}/{doc['metadata'].get('name')}: {e}")
    # Everything namespaced lands in a namespace the values name (release or watched).
    allowed = {NAMESPACE, *VARIANTS[variant].get("watch.namespaces", [])}
    for doc in docs:
        if doc["kind"] not in (
            "CustomResourceDefinition",
            "ClusterRole",
            "ClusterRoleBinding",
            "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicyBinding",
        ):
            assert doc["metadata"]["namespace"] in allowed, doc["kind"]


def test_kubernetes_validate_rejects_a_broken_render() -> None:
    """The strict validation above can fail: an unknown field in the Deployment is caught."""
    doc = operator_deployment(helm_template())
    doc["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["pth"] = "/healthz"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSIONS[0], strict=True)


def test_optional_objects_follow_their_switches() -> None:
    kinds = lambda docs: sorted(d["kind"] for d in docs)  # noqa: E731
    default = helm_template()
    # Namespace scope by default (issue 27): a Role for the watched namespace and one for the Lease.
    # ... and the tenant policy as a ValidatingAdmissionPolicy.
    assert kinds(default) == [
        "Deployment",
        "PodDisruptionBudget",
        "Role",
        "Role",
        "RoleBinding",
        "RoleBinding",
        "Secret",
        "Service",
        "ServiceAccount",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    ]
    everything = helm_template(ALL_ON)
    assert kinds(everything) == sorted(
        kinds(default) + ["ConfigMap", "DSV4Deployment", "ServiceMonitor", "ServiceMonitor"]
    )
    minimal = helm_template(VARIANTS["minimal"])
    assert kinds(minimal) == ["Deployment", "PodDisruptionBudget"]
    assert operator_deployment(minimal)["spec"]["template"]["spec"]["serviceAccountName"] == "existing-sa"
    # The CRD comes with --include-crds only (Helm installs crds/ itself, before the templates).
    assert not by_kind(default, "CustomResourceDefinition")


# ---- the operator Deployment --------------------------------------------------------------------


def test_operator_pod_is_hardened_and_probed() -> None:
    docs = helm_template()
    dep = operator_deployment(docs)
    pod = dep["spec"]["template"]["spec"]
    c = operator_container(docs)
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert (
        c["resources"]["requests"]["cpu"]
        and c["resources"]["requests"]["memory"]
        and c["resources"]["limits"]["memory"]
    )
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "health"}, probe
    assert c["ports"] == [{"name": "health", "containerPort": 8080, "protocol": "TCP"}]
    assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]  # writable scratch on a read-only root
    assert pod["serviceAccountName"] == RELEASE
    assert c["image"] == "dsv4-operator:0.1.0"  # the chart's appVersion


def test_operator_replicas_elect_a_leader_and_roll_without_a_gap() -> None:
    """Two replicas by default, leader election on (no --standalone); an upgrade starts the new
    pod before it stops an old one, the replicas prefer different nodes, a drain takes one at a
    time, and the Lease is found in the pod's own namespace."""
    docs = helm_template()
    dep, c = operator_deployment(docs), operator_container(docs)
    assert dep["spec"]["replicas"] == 2
    assert dep["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
    assert "--standalone" not in c["args"]
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert "DSV4_RESTART_RATE_LIMIT" not in env  # the operator's default
    selector = dep["spec"]["selector"]["matchLabels"]
    spread = dep["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"
    ]
    assert spread == [
        {
            "weight": 100,
            "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": selector}},
        }
    ]
    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": selector}}
    assert pdb["metadata"]["namespace"] == NAMESPACE


def test_standalone_runs_one_replica_that_never_overlaps() -> None:
    docs = helm_template(STANDALONE)
    dep, c = operator_deployment(docs), operator_container(docs)
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"] == {"type": "Recreate"}
    assert c["args"][0] == "--standalone"
    assert "affinity" not in dep["spec"]["template"]["spec"] and not by_kind(docs, "PodDisruptionBudget")
    assert not by_kind(helm_template({"podDisruptionBudget.enabled": False}), "PodDisruptionBudget")


def test_operator_values_reach_the_pod() -> None:
    variant = VARIANTS["three-replicas-own-affinity-rate-limit"]
    docs = helm_template(variant)
    dep, c = operator_deployment(docs), operator_container(docs)
    assert dep["spec"]["replicas"] == 3
    assert {"name": "DSV4_RESTART_RATE_LIMIT", "value": "4/300"} in c["env"]
    assert dep["spec"]["template"]["spec"]["affinity"] == variant["affinity"]  # the user's, not the default
    from dsv4_operator.watchdog.corroboration import RestartRateLimit

    limit = RestartRateLimit.parse("4/300")  # the form the operator reads
    assert (limit.max_restarts, limit.per_seconds) == (4, 300.0)


def test_operator_args_follow_the_watch_scope() -> None:
    cluster = operator_container(helm_template({"watch.scope": "cluster"}))["args"]
    assert cluster == ["--health-port=8080", "--log-format=json"]
    assert operator_container(helm_template())["args"][-1] == f"--namespace={NAMESPACE}"  # the default
    namespaced = operator_container(helm_template({"watch.scope": "namespaces", "watch.namespaces": ["a", "b", "a"]}))[
        "args"
    ]
    assert namespaced == ["--health-port=8080", "--log-format=json", "--namespace=a", "--namespace=b"]
    own = operator_container(helm_template({"watch.scope": "namespaces"}))["args"]
    assert own[-1] == f"--namespace={NAMESPACE}"
    port = operator_container(helm_template({"operator.healthPort": 9090, "operator.logFormat": "plain"}))
    assert "--health-port=9090" in port["args"] and "--log-format=plain" in port["args"]
    assert port["ports"][0]["containerPort"] == 9090


def test_the_operator_cli_accepts_the_rendered_args(monkeypatch: pytest.MonkeyPatch) -> None:
    """The args the chart passes are flags `dsv4 operator` knows: its own parser reads them (the
    operator itself is not started; what it was asked to run is captured)."""
    from typer.testing import CliRunner

    import dsv4_operator.main as operator_main
    from dsv4_cli.main import app

    args = operator_container(helm_template({"watch.scope": "namespaces", "watch.namespaces": ["a"]}))["args"]
    called: dict[str, Any] = {}
    monkeypatch.setattr(operator_main, "run_operator", lambda **kw: called.update(kw))
    result = CliRunner().invoke(app, ["operator", *args])
    assert result.exit_code == 0, result.output
    assert called == {"namespaces": ["a"], "standalone": False, "health_port": 8080, "log_format": "json"}
    standalone = operator_container(helm_template(STANDALONE))["args"]
    called.clear()
    result = CliRunner().invoke(app, ["operator", *standalone])
    assert result.exit_code == 0, result.output
    assert called["standalone"] is True


# ---- RBAC -----------------------------------------------------------------------------------------


def test_cluster_scope_uses_a_cluster_role_bound_to_the_service_account() -> None:
    docs = [
        d for d in helm_template({"watch.scope": "cluster"}) if not d["metadata"]["name"].endswith("-leader-election")
    ]
    assert not by_kind(docs, "Role") and not by_kind(docs, "RoleBinding")  # but the Lease's, below
    role, binding = one(docs, "ClusterRole"), one(docs, "ClusterRoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": RELEASE, "namespace": NAMESPACE}]


def test_namespaced_scope_uses_a_role_in_each_watched_namespace_and_nothing_cluster_wide() -> None:
    docs = helm_template({"watch.scope": "namespaces", "watch.namespaces": ["team-a", "team-b"]})
    assert not by_kind(docs, "ClusterRole") and not by_kind(docs, "ClusterRoleBinding")
    election = [d for d in docs if d["metadata"]["name"].endswith("-leader-election")]
    assert sorted((d["kind"], d["metadata"]["namespace"]) for d in election) == [
        ("Role", NAMESPACE),
        ("RoleBinding", NAMESPACE),
    ]  # the leader Lease lives in the release namespace
    docs = [d for d in docs if d not in election]
    roles, bindings = by_kind(docs, "Role"), by_kind(docs, "RoleBinding")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    for b in bindings:
        assert b["roleRef"]["kind"] == "Role"
        assert b["subjects"] == [{"kind": "ServiceAccount", "name": RELEASE, "namespace": NAMESPACE}]
    cluster_rules = one(helm_template({"watch.scope": "cluster"}), "ClusterRole")["rules"]
    for r in roles:
        assert r["rules"] == cluster_rules  # one list of rules, two scopes


def test_rbac_has_no_wildcards_and_nothing_that_escalates() -> None:
    for values in ({}, {"watch.scope": "cluster"}):
        rules = rbac_rules(helm_template(values))
        assert rules
        for rule in rules:
            assert set(rule) <= {"apiGroups", "resources", "verbs"}, rule  # no nonResourceURLs
            for key in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule[key] and all("*" not in v for v in rule[key]), rule
        verbs = {v for _, _, v in grants(rules)}
        assert not verbs & {"escalate", "bind", "impersonate", "deletecollection"}
        # update only where owner references need it (blockOwnerDeletion), nowhere else: writes are applies.
        assert {r for _, r, v in grants(rules) if v == "update"} == {"dsv4deployments/finalizers"}
        resources = {r for _, r, _ in grants(rules)}
        assert not resources & {"clusterroles", "clusterrolebindings", "nodes", "namespaces"}
        # Secrets: the deployments' auth Secrets, one by one; never listed or watched (that would
        # hand the operator every Secret's value in bulk).
        # Never patched either (issue 27): tokens are derived from the operator key and the
        # deployment's uid, so a create suffices; get checks an existing one is the operator's.
        assert {v for _, r, v in grants(rules) if r == "secrets"} == {"get", "create"}


def test_default_install_has_no_cluster_wide_secret_verbs_and_an_operator_key() -> None:
    docs = helm_template()
    assert not by_kind(docs, "ClusterRole") and not by_kind(docs, "ClusterRoleBinding")
    for role in by_kind(docs, "Role"):
        assert role["metadata"]["namespace"] == NAMESPACE
    secret = one(docs, "Secret")
    assert secret["metadata"]["name"] == f"{RELEASE}-key" and len(secret["data"]["key"]) >= 48
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    c = operator_container(docs)
    pod = operator_deployment(docs)["spec"]["template"]["spec"]
    assert {"name": "DSV4_OPERATOR_KEY_FILE", "value": "/etc/dsv4-operator/key/key"} in c["env"]
    (vol,) = [v for v in pod["volumes"] if v["name"] == "operator-key"]
    assert vol["secret"]["secretName"] == f"{RELEASE}-key"
    mine = helm_template({"operatorKey.existingSecret": "my-key"})
    assert not by_kind(mine, "Secret")
    (vol,) = [
        v for v in operator_deployment(mine)["spec"]["template"]["spec"]["volumes"] if v["name"] == "operator-key"
    ]
    assert vol["secret"]["secretName"] == "my-key"


def test_image_digest_pins_the_operator_image_when_set() -> None:
    digest = "sha256:" + "ab" * 32
    assert operator_container(helm_template({"image.digest": digest}))["image"] == f"dsv4-operator@{digest}"
    assert operator_container(helm_template())["image"] == "dsv4-operator:0.1.0"


def test_the_operator_holds_what_its_router_role_grants() -> None:
    """The API server lets a subject create a Role only with permissions it holds itself (no
    `escalate`): every rule of the Role the operator writes for its router must be in the chart."""
    spec = parse_spec(yaml.safe_load((REPO / "crds" / "examples" / "flash-builtin.yaml").read_text())["spec"])
    children = manifests.build_children(spec, manifests.Owner("flash", "team-a", "uid-1"))
    child_roles = [c for c in children if c["kind"] in ("Role", "ClusterRole")]
    assert child_roles
    held = grants(rbac_rules(helm_template()))
    for role in child_roles:
        missing = grants(role["rules"]) - held
        assert not missing, f"the operator could not create {role['kind']}/{role['metadata']['name']}: {missing}"


# ---- values.schema.json -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "values, complaint",
    [
        ({"watch.scope": "everywhere"}, "/watch/scope"),
        ({"watch.namespaces": ["Team_A"]}, "/watch/namespaces/0"),
        ({"operator.healthPort": 0}, "/operator/healthPort"),
        ({"operator.healthPort": "8080"}, "/operator/healthPort"),
        ({"operator.logFormat": "xml"}, "/operator/logFormat"),
        ({"image.pullPolicy": "Sometimes"}, "/image/pullPolicy"),
        ({"image.repository": ""}, "/image/repository"),
        ({"replicaCount": 0}, "/replicaCount"),
        ({"leaderElection.enabled": False}, "/replicaCount"),  # standalone: one replica, or two would act
        ({"leaderElection.enabled": False, "replicaCount": 3}, "/replicaCount"),
        ({"operator.restartRateLimit": "10 per hour"}, "/operator/restartRateLimit"),
        ({"podDisruptionBudget": {"enable": True}}, "/podDisruptionBudget"),
        ({"rbac.create": "yes"}, "/rbac/create"),
        ({"metrics.serviceMonitor.interval": "30 seconds"}, "/metrics/serviceMonitor/interval"),
        ({"sample.name": "Flash"}, "/sample/name"),
        ({"sample.name": "f" * 45}, "/sample/name"),
        ({"sample.spec.model": None}, "/sample/spec"),  # null removes the default model
        ({"podLabels": {"team": 1}}, "/podLabels/team"),
    ],
)
def test_schema_rejects_bad_values(values: dict[str, Any], complaint: str) -> None:
    with pytest.raises(HelmError) as err:
        helm_template(values)
    assert "values don't meet the specifications" in str(err.value)
    assert complaint in str(err.value)


def test_schema_limits_match_the_operator() -> None:
    """The sample's name limit is the operator's: longer names make invalid StatefulSet labels."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    name = schema["properties"]["sample"]["properties"]["name"]
    assert name["maxLength"] == manifests.MAX_NAME_LENGTH
    assert name["pattern"] == manifests._DNS1035.pattern
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.Draft7Validator(schema).validate(values)  # the defaults pass their own schema


def test_sample_outside_the_watched_namespaces_is_refused() -> None:
    with pytest.raises(HelmError, match="which watch.namespaces leaves out"):
        helm_template({"watch.scope": "namespaces", "watch.namespaces": ["team-a"], "sample.enabled": True})


# ---- the CRD and the samples ----------------------------------------------------------------------------


def test_the_chart_crd_is_the_top_level_crd() -> None:
    """A symlink, so there is one file and nothing to keep in sync; Helm follows it, and
    `helm package` stores its contents. Checked byte for byte too: a checkout without symlinks
    (core.symlinks=false) would leave a one-line text file here, and this must fail then."""
    chart_crd = CHART / "crds" / "dsv4deployment.yaml"
    assert chart_crd.is_symlink() and chart_crd.resolve() == CRD_FILE.resolve()
    assert chart_crd.read_bytes() == CRD_FILE.read_bytes()
    assert [p.name for p in (CHART / "crds").iterdir()] == ["dsv4deployment.yaml"]
    rendered = one(helm_template(include_crds=True), "CustomResourceDefinition")
    assert rendered == yaml.safe_load(CRD_FILE.read_text())


def test_the_packaged_chart_carries_the_crd_contents(tmp_path: Path) -> None:
    run_helm("package", str(CHART), "--destination", str(tmp_path))
    import tarfile

    (archive,) = tmp_path.glob("dsv4-operator-*.tgz")
    with tarfile.open(archive) as tar:
        member = tar.getmember("dsv4-operator/crds/dsv4deployment.yaml")
        assert member.isfile()  # contents, not a link
        assert tar.extractfile(member).read() == CRD_FILE.read_bytes()


@pytest.mark.parametrize("source", ["chart-values", "e2e"])
def test_samples_validate_against_the_crd_and_the_operator(source: str) -> None:
    if source == "chart-values":
        cr = one(helm_template({"sample.enabled": True}), "DSV4Deployment")
    else:
        cr = yaml.safe_load((REPO / "tests" / "e2e" / "tiny-cpu.yaml").read_text())
    jsonschema.validate(cr, crd_jsonschema(yaml.safe_load(CRD_FILE.read_text())))
    spec = parse_spec(cr["spec"])
    assert manifests.unbuildable_reasons(cr["metadata"]["name"], spec) == []


def test_the_crd_schema_check_can_fail() -> None:
    cr = one(
        helm_template(
            {
                "sample.enabled": True,
                "sample.spec": {"model": {"name": "m", "path": "relative"}, "engine": {"image": "x", "kind": "vllm"}},
            }
        ),
        "DSV4Deployment",
    )
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(cr, crd_jsonschema(yaml.safe_load(CRD_FILE.read_text())))


# ---- NOTES.txt --------------------------------------------------------------------------------------------


def test_notes_say_what_to_run_next() -> None:
    notes = helm_notes()
    assert f"kubectl -n {NAMESPACE} rollout status deployment/{RELEASE}" in notes
    assert "get dsv4d -w" in notes and "port-forward svc/NAME-router 8000:8000" in notes
    assert "serving.dsv4.dev/evidence=true" in notes and "docs/operations.md" in notes
    assert f"in: {NAMESPACE}" in notes  # namespace scope by default
    assert "every namespace" in helm_notes({"watch.scope": "cluster"})
    ns = helm_notes({"watch.scope": "namespaces", "watch.namespaces": ["team-a"], "sample.enabled": False})
    assert "in: team-a" in ns and "kubectl -n team-a get dsv4d -w" in ns
    sample = helm_notes(
        {"sample.enabled": True, "metrics.serviceMonitor.enabled": True, "grafanaDashboard.enabled": True}
    )
    assert f"kubectl -n {NAMESPACE} get dsv4d flash -w" in sample
    assert "ServiceMonitors" in sample and f"ConfigMap {RELEASE}-dashboard" in sample


def test_helm_is_the_real_binary() -> None:
    out = run_helm("version", "--short").stdout
    assert out.startswith("v4."), out
    require_tool("kubectl")
