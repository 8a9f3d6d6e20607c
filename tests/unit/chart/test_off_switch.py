"""The fleet-wide remediation off switch docs/operations.md documents (issue 43):
`operator.restartRateLimit=0/600` reaches the operator as a limit that lets no remediation start."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: chart_testutil
from chart_testutil import REPO, helm_template, one  # noqa: E402

from dsv4_operator.main import RESTART_RATE_LIMIT_ENV  # noqa: E402
from dsv4_operator.watchdog.corroboration import RestartRateLimit  # noqa: E402


def test_a_zero_rate_limit_renders_and_allows_nothing() -> None:
    assert "--set operator.restartRateLimit=0/600" in (REPO / "docs" / "operations.md").read_text()
    container = one(helm_template({"operator.restartRateLimit": "0/600"}), "Deployment")["spec"]["template"]["spec"][
        "containers"
    ][0]
    value = {e["name"]: e.get("value") for e in container["env"]}[RESTART_RATE_LIMIT_ENV]
    assert RestartRateLimit.parse(value).allowance(now=0.0) == 0
