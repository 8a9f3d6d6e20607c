"""docs/metrics.md is generated from the code's metric definitions (scripts/gen_metrics_docs.py)
and kept current; it names the engine's, the router's and the operator's metrics."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "scripts"))
import gen_metrics_docs  # noqa: E402


def test_the_reference_is_current() -> None:
    assert gen_metrics_docs.main(["--check"]) == 0, "run: python scripts/gen_metrics_docs.py"


def test_it_names_every_component_and_follows_the_code(tmp_path: Path) -> None:
    text = gen_metrics_docs.render()
    for name in (
        "`dsv4:num_prefill_inflight_queue_reqs` | gauge | `role`, `model_name`",
        "`dsv4:kv_transfers_completed_total` | counter",
        "`dsv4:router_migrations_total` | counter | `reason`",
        "`dsv4_router:rejected_total` | counter",
        "`dsv4_operator_wedged_pods` | gauge | `namespace`, `deployment`",
        "`dsv4:node_group_ready` | gauge",
    ):
        assert name in text, name
    stale = tmp_path / "metrics.md"
    stale.write_text(text.replace("dsv4_router:rejected_total", "dsv4_router:refused_total"))
    assert gen_metrics_docs.main(["--check", "--out", str(stale)]) == 1
