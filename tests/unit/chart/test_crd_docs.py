"""docs/crd-reference.md is generated from the CRD by scripts/gen_crd_docs.py; keep it current."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "scripts"))
import gen_crd_docs  # noqa: E402


def crd() -> dict:
    return yaml.safe_load(gen_crd_docs.CRD_PATH.read_text())


def test_the_reference_is_current() -> None:
    assert gen_crd_docs.main(["--check"]) == 0, "run: python scripts/gen_crd_docs.py"


def test_every_schema_field_is_documented() -> None:
    text = gen_crd_docs.render(crd())
    schema = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for top in ("spec", "status"):
        for path, _, _ in gen_crd_docs.walk(schema["properties"][top], top):
            assert f"`{path}`" in text or f"### {path}\n" in text, path


def test_a_schema_change_changes_the_reference(tmp_path: Path) -> None:
    changed = copy.deepcopy(crd())
    remediation = changed["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "remediation"
    ]
    remediation["properties"]["cooldownSeconds"]["default"] = 42
    remediation["properties"]["cooldownSeconds"]["description"] = "Seconds between two restarts of one pod."
    text = gen_crd_docs.render(changed)
    assert (
        "| `spec.remediation.cooldownSeconds` | integer | `42` | >= 0 | Seconds between two restarts of one pod. |"
        in text
    )
    crd_file = tmp_path / "crd.yaml"
    crd_file.write_text(yaml.safe_dump(changed))
    assert gen_crd_docs.main(["--check", "--crd", str(crd_file)]) == 1


def test_what_the_reference_says() -> None:
    text = gen_crd_docs.render(crd())
    assert "`apiVersion: serving.dsv4.dev/v1alpha1`, `kind: DSV4Deployment`" in text
    assert '| `spec.engine.kind` | string | `"builtin"` | one of `builtin`, `sglang` |' in text
    assert "| `spec.model.name` | string |  | **required**; min length 1 |" in text
    assert "| WEDGED | `.status.wedgedPods` | always |" in text
    assert (
        "| `status.conditions[].type` | string |  | **required**; one of `Available`, `Progressing`, `Degraded`, `Wedged` |"
        in text
    )
