"""A user's first apply (issue 43): the README's Kubernetes commands, run as written against the
strict emulator with the operator the chart renders for them, put the example where the operator
reads it; and `kubectl get dsv4d -A` (the WATCHED-BY column, `status.watchedBy`) tells that
resource from one applied into a namespace no operator watches."""

from __future__ import annotations

import asyncio
import re
import shlex
import sys
from pathlib import Path

import yaml

from bench.harness.kmock_cluster import ClusterClient, KubeCluster, eventually
from test_operator_kmock import PLURAL, get_cr

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: chart_testutil
from chart_testutil import REPO, helm_template  # noqa: E402

README = REPO / "README.md"


def readme_commands() -> list[list[str]]:
    """The shell commands of the README's code blocks, continuation lines joined, comments dropped."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
    text = "\n".join(blocks).replace("\\\n", " ")
    commands = []
    for line in text.splitlines():
        line = line.split(" #", 1)[0].strip().rstrip("&").strip()
        if line and not line.startswith("#"):
            commands.append(shlex.split(line))
    return commands


def option(argv: list[str], *names: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg in names and i + 1 < len(argv):
            return argv[i + 1]
        for name in names:
            if name.startswith("--") and arg.startswith(name + "="):
                return arg.split("=", 1)[1]
    return None


def the_readme_recipe() -> tuple[str, str, Path]:
    """(release namespace, namespace the example is applied into, the example file)."""
    commands = readme_commands()
    (helm,) = [c for c in commands if c[:2] == ["helm", "install"]]
    (apply,) = [c for c in commands if c[:1] == ["kubectl"] and "apply" in c and "crds/examples" in " ".join(c)]
    release_ns = option(helm, "-n", "--namespace")
    target_ns = option(apply, "-n", "--namespace") or "default"
    return release_ns, target_ns, REPO / option(apply, "-f", "--filename")


def test_the_readme_recipe_is_found() -> None:
    release_ns, target_ns, example = the_readme_recipe()
    assert release_ns and example.is_file()
    assert target_ns == "dsv4-system"


async def test_the_example_applied_as_the_readme_says_is_served(
    cluster_with_crd: KubeCluster, kube_client: ClusterClient, operator_factory
) -> None:
    release_ns, target_ns, example = the_readme_recipe()
    operator = helm_template(namespace=release_ns)
    (deployment,) = [d for d in operator if d["kind"] == "Deployment"]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    watched = [a.split("=", 1)[1] for a in args if a.startswith("--namespace=")]
    await operator_factory(watched)

    body = yaml.safe_load(example.read_text())
    name = body["metadata"]["name"]
    await kube_client.create({**body, "metadata": {**body["metadata"], "namespace": target_ns}}, PLURAL)
    # The mistake the issue reports: the same file applied without -n lands in `default`.
    await kube_client.create({**body, "metadata": {**body["metadata"], "namespace": "default"}}, PLURAL)

    async def served() -> dict:
        cr = await get_cr(kube_client, target_ns, name)
        status = (cr or {}).get("status") or {}
        return status.get("watchedBy") and status.get("observedGeneration") and cr

    cr = await eventually(served, timeout=20)
    assert cr["status"]["observedGeneration"] == 1
    await asyncio.sleep(1)
    ignored = await get_cr(kube_client, "default", name)
    assert "watchedBy" not in (ignored.get("status") or {}), "nobody watches default with the chart's defaults"

    # What `kubectl get dsv4d -A` prints in the WATCHED-BY column: the CRD's own printer column.
    crd = yaml.safe_load((REPO / "crds" / "dsv4deployment.yaml").read_text())
    (column,) = [c for c in crd["spec"]["versions"][0]["additionalPrinterColumns"] if c["name"] == "Watched-By"]
    assert column["jsonPath"] == ".status.watchedBy" and not column.get("priority")
