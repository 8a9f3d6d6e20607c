"""The chart's sample exposes dpAttention and redundantExperts per role (issue 46), checked with
the real helm: `helm lint --strict` with them on, `helm template` renders a DSV4Deployment the
CRD admits (schema and CEL rules) that the operator turns into engines with the flags. (A layout
the replica cannot hold is refused by the CRD's rules: test_operator_cel.)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: chart_testutil

from chart_testutil import CHART, CRD_FILE, NAMESPACE, helm_template, one, run_helm  # noqa: E402
from dsv4_operator import manifests  # noqa: E402
from dsv4_operator.crd import apply_defaults, cel_violations, crd_jsonschema, prune_unknown  # noqa: E402
from dsv4_operator.spec import parse_spec  # noqa: E402

ON = {"sample.enabled": True, "sample.spec.decode.dpAttention": True, "sample.spec.decode.redundantExperts": 2}


def admission_errors(cr: dict) -> list[str]:
    import jsonschema

    crd = yaml.safe_load(CRD_FILE.read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    obj = prune_unknown(apply_defaults(cr, schema), schema)
    errors = [e.message for e in jsonschema.Draft202012Validator(crd_jsonschema(crd)).iter_errors(obj)]
    return errors + cel_violations(obj, schema)


def test_the_default_sample_leaves_both_off():
    cr = one(helm_template({"sample.enabled": True}), "DSV4Deployment")
    for role in ("prefill", "decode"):
        assert cr["spec"][role]["dpAttention"] is False and cr["spec"][role]["redundantExperts"] == 0
        assert "--dp-size" not in manifests.engine_command(parse_spec(cr["spec"]), role)


def test_helm_lint_strict_with_the_layout_on():
    args = [a for k, v in ON.items() for a in ("--set-json", f"{k}={json.dumps(v)}")]
    proc = run_helm("lint", "--strict", str(CHART), "--namespace", NAMESPACE, *args, check=False)
    assert proc.returncode == 0 and "0 chart(s) failed" in proc.stdout, proc.stdout + proc.stderr


def test_the_rendered_sample_is_admitted_and_becomes_the_engine_flags():
    cr = one(helm_template(ON), "DSV4Deployment")
    assert admission_errors(cr) == []
    spec = parse_spec(cr["spec"])
    assert manifests.unbuildable_reasons(cr["metadata"]["name"], spec) == []
    cmd = manifests.engine_command(spec, "decode")
    at = {f: cmd[cmd.index(f) + 1] for f in ("--tp-size", "--dp-size", "--ep-redundant-experts")}
    assert at == {"--tp-size": "4", "--dp-size": "4", "--ep-redundant-experts": "2"}
    assert "--dp-size" not in manifests.engine_command(spec, "prefill")
