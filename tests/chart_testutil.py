"""Helpers for the tests of the Helm chart and the images: find (or fetch) helm and hadolint,
render the chart, and read what it renders.

The tools come from scripts/get-tools.sh (into .tools/bin). A test that needs one and cannot get
it skips with the reason the script gave; nothing here pretends a tool ran.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any, Iterable, Optional

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "charts" / "dsv4-operator"
CRD_FILE = REPO / "crds" / "dsv4deployment.yaml"
TOOLS_BIN = REPO / ".tools" / "bin"
GET_TOOLS = REPO / "scripts" / "get-tools.sh"
RELEASE = "dsv4-operator"  # the release name the docs use: objects are named dsv4-operator
NAMESPACE = "dsv4-system"


@functools.lru_cache(maxsize=None)
def _fetch_tools() -> str:
    """Run scripts/get-tools.sh once per session; its complaint, or "" when it succeeded."""
    try:
        proc = subprocess.run(["bash", str(GET_TOOLS)], cwd=REPO, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"scripts/get-tools.sh did not finish: {e}"
    if proc.returncode == 0:
        return ""
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("get-tools:")] or proc.stderr.splitlines()[-3:]
    return "; ".join(lines) or f"scripts/get-tools.sh exited {proc.returncode}"


def find_tool(name: str) -> Optional[str]:
    """.tools/bin/NAME, else NAME on PATH, else fetch it with scripts/get-tools.sh."""
    local = TOOLS_BIN / name
    if os.access(local, os.X_OK):
        return str(local)
    on_path = shutil.which(name)
    if on_path and name != "helm":  # helm must be ours (v4); another one on PATH may be v2/v3
        return on_path
    _fetch_tools()
    return str(local) if os.access(local, os.X_OK) else None


def require_tool(name: str) -> str:
    path = find_tool(name)
    if path is None:
        pytest.skip(
            f"{name} could not be obtained ({_fetch_tools() or 'no reason given'}); "
            f"run scripts/get-tools.sh or put {name} in .tools/bin"
        )
    return path


class HelmError(Exception):
    pass


def run_helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    helm = require_tool("helm")
    proc = subprocess.run([helm, *args], cwd=REPO, capture_output=True, text=True, timeout=60)
    if check and proc.returncode != 0:
        raise HelmError(proc.stderr.strip() or proc.stdout.strip())
    return proc


def _set_args(values: Optional[dict[str, Any]]) -> list[str]:
    if not values:
        return []
    # --set-json keeps types exact (a "1" stays a string, 1 an integer), unlike --set.
    return [arg for key, value in values.items() for arg in ("--set-json", f"{key}={json.dumps(value)}")]


def helm_template(
    values: Optional[dict[str, Any]] = None,
    *,
    namespace: str = NAMESPACE,
    release: str = RELEASE,
    include_crds: bool = False,
    kube_version: Optional[str] = None,
    api_versions: tuple[str, ...] = (),
) -> list[dict[str, Any]]:
    """`helm template` of the chart with `values` (dotted keys -> JSON values); the documents
    (a fresh copy each call: renders are cached per session, tests may change what they get).
    `kube_version` / `api_versions`: the cluster helm renders for (its Capabilities)."""
    key = json.dumps(values or {}, sort_keys=True)
    return copy.deepcopy(_render(key, namespace, release, include_crds, kube_version, api_versions))


@functools.lru_cache(maxsize=None)
def _render(
    values_json: str,
    namespace: str,
    release: str,
    include_crds: bool,
    kube_version: Optional[str] = None,
    api_versions: tuple[str, ...] = (),
) -> list[dict[str, Any]]:
    args = ["template", release, str(CHART), "--namespace", namespace, *_set_args(json.loads(values_json))]
    if include_crds:
        args.append("--include-crds")
    if kube_version:
        args += ["--kube-version", kube_version]
    for api in api_versions:
        args += ["--api-versions", api]
    out = run_helm(*args).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def helm_notes(values: Optional[dict[str, Any]] = None, *, namespace: str = NAMESPACE) -> str:
    """NOTES.txt as `helm install` prints it, rendered offline (client-side dry run)."""
    proc = run_helm(
        "install",
        RELEASE,
        str(CHART),
        "--namespace",
        namespace,
        "--dry-run=client",
        "--hide-notes=false",
        *_set_args(values),
        check=False,
    )
    if proc.returncode != 0:
        raise HelmError(proc.stderr.strip())
    _, _, notes = proc.stdout.partition("NOTES:\n")
    return notes


def by_kind(docs: Iterable[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d.get("kind") == kind]


def one(docs: Iterable[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def rbac_rules(docs: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every rule of every Role and ClusterRole the chart renders."""
    return [rule for d in docs if d.get("kind") in ("Role", "ClusterRole") for rule in d.get("rules", [])]


def grants(rules: Iterable[dict[str, Any]]) -> set[tuple[str, str, str]]:
    """{(apiGroup, resource, verb)} the rules grant, expanded (wildcards are kept as '*')."""
    out = set()
    for rule in rules:
        for group in rule.get("apiGroups", []):
            for resource in rule.get("resources", []):
                for verb in rule.get("verbs", []):
                    out.add((group, resource, verb))
    return out


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())
