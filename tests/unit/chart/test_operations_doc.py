"""docs/operations.md states defaults and grants in tables; they must match what ships: the
chart's values.yaml, the CRD's defaults, and the RBAC rules the chart renders."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: chart_testutil

from chart_testutil import CHART, CRD_FILE, REPO, grants, helm_template, rbac_rules  # noqa: E402

DOC = REPO / "docs" / "operations.md"


def table_after(heading: str) -> list[list[str]]:
    """The rows (cells stripped) of the first Markdown table after a heading line."""
    lines = DOC.read_text().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.strip() == heading)
    rows, seen_table = [], False
    for ln in lines[start + 1 :]:
        if ln.startswith("|"):
            seen_table = True
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", ln.strip())[1:-1]]
            if not all(set(c) <= {"-", ":"} for c in cells):
                rows.append(cells)
        elif seen_table:
            break
    return rows[1:]  # without the header


def ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def lookup(tree: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        tree = tree[part]
    return tree


def test_chart_values_table_matches_values_yaml() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    rows = table_after("### Chart values worth knowing")
    assert len(rows) >= 5
    for key_cell, default_cell, _ in rows:
        keys, defaults = ticked(key_cell), ticked(default_cell)
        for i, key in enumerate(keys):
            actual = lookup(values, key)
            if i < len(defaults) and key != "image.tag":  # image.tag's default is "the appVersion"
                assert str(actual).lower() == defaults[i].lower(), (key, actual, defaults[i])


def test_remediation_table_matches_the_crd_defaults() -> None:
    crd = yaml.safe_load(CRD_FILE.read_text())
    remediation = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "remediation"
    ]
    rows = table_after("## 6. Tuning detection")
    documented = set()
    for field_cell, default_cell, _ in rows:
        for name in ticked(field_cell):
            name = name.lstrip(".")
            path = name if "." in name or name in remediation["properties"] else None
            if path is None:  # `.decode` after `maxUnavailable.prefill`: same parent
                continue
            node = remediation
            for part in path.split("."):
                node = node["properties"][part]
            cell = ticked(default_cell)[0]
            if "default" not in node:  # derived at run time: the table says so
                assert cell == "unset", name
            else:
                assert json.loads(cell.replace("suggest", '"suggest"')) == node["default"], name
            documented.add(path.split(".")[0])
    assert documented == set(remediation["properties"]), set(remediation["properties"]) ^ documented


def test_rbac_table_matches_the_chart() -> None:
    granted = grants(rbac_rules(helm_template()))
    by_resource: dict[str, set[str]] = {}
    for _, resource, verb in granted:
        by_resource.setdefault(resource, set()).add(verb)
    rows = table_after("### RBAC: what the operator may do, and why")
    documented = set()
    for api_cell, verbs_cell, _ in rows:
        verbs = {v.strip() for v in verbs_cell.split(",")}
        for resource in ticked(api_cell):
            assert by_resource[resource] == verbs, (resource, by_resource[resource], verbs)
            documented.add(resource)
    assert documented == set(by_resource), set(by_resource) ^ documented
