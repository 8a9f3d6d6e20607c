"""Every shipped example runs under the chart's default tenant policy (issue 43): the operator's
reconcile-time check (dsv4_operator.tenant_policy, with the chart's default values) and the
ValidatingAdmissionPolicy's CEL both admit it; no example pins a NIC name that exists only on
some clusters, and none sets a detection window the engine's own deadlines outlast (the operations
guide: keep the window above them, or a transfer the engine would fail is remediated first)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: chart_testutil
from chart_testutil import CHART, REPO, helm_template, one  # noqa: E402
from test_tenant_admission_policy import _admits  # noqa: E402

from dsv4_operator.spec import DEADLINE_MARGIN_SECONDS, parse_spec  # noqa: E402
from dsv4_operator.tenant_policy import TenantPolicy, policy_violations  # noqa: E402

EXAMPLES = sorted((REPO / "crds" / "examples").glob("*.yaml"))


def default_policy() -> TenantPolicy:
    return TenantPolicy.from_mapping(yaml.safe_load((CHART / "values.yaml").read_text())["tenantPolicy"])


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_the_default_tenant_policy_admits_every_example(path: Path) -> None:
    spec = parse_spec(yaml.safe_load(path.read_text())["spec"])
    assert policy_violations(spec, default_policy()) == []
    vap = one(helm_template(), "ValidatingAdmissionPolicy")  # the chart's defaults
    assert _admits(vap, spec.model_dump(by_alias=True, exclude_none=True)), path.name


def test_the_check_refuses_a_root_sglang_spec() -> None:
    """The check above can fail: the SGLang example without its runAsUser is refused both ways."""
    cr = yaml.safe_load((REPO / "crds" / "examples" / "flash-sglang.yaml").read_text())
    del cr["spec"]["security"]
    spec = parse_spec(cr["spec"])
    assert policy_violations(spec, default_policy())
    assert not _admits(
        one(helm_template(), "ValidatingAdmissionPolicy"), spec.model_dump(by_alias=True, exclude_none=True)
    )


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_no_example_pins_a_nic_or_a_window_below_the_deadlines(path: Path) -> None:
    cr = yaml.safe_load(path.read_text())
    spec = parse_spec(cr["spec"])
    assert not spec.transfer.ucx_net_devices, "a NIC name is the user's to set (commented in the example)"
    assert not any(re.search(r"UCX_NET_DEVICES", e.name) for e in spec.transfer.env)
    if spec.engine.kind == "builtin":
        t = spec.transfer
        assert spec.detection_window() >= t.bootstrap_timeout_seconds + t.transfer_timeout_seconds + (
            DEADLINE_MARGIN_SECONDS
        ), "the window must outlast the engine's own PD deadlines"
