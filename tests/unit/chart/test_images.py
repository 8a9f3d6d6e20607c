"""The container images (images/*.Dockerfile): hadolint finds nothing, the build context the
.dockerignore leaves holds everything the Dockerfiles copy, and the operator image's slim
dependency set (scripts/operator_requirements.py) is enough to run `dsv4 operator`.

Building the images needs Docker; tests/e2e/kind.sh does that where a daemon answers.
"""

from __future__ import annotations

import fnmatch
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: chart_testutil

from chart_testutil import REPO, require_tool  # noqa: E402

sys.path.insert(0, str(REPO / "scripts"))
import operator_requirements  # noqa: E402

DOCKERFILES = sorted((REPO / "images").glob("*.Dockerfile"))


def test_both_dockerfiles_exist() -> None:
    assert [p.name for p in DOCKERFILES] == ["engine.Dockerfile", "operator.Dockerfile"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_finds_nothing(dockerfile: Path) -> None:
    hadolint = require_tool("hadolint")
    proc = subprocess.run([hadolint, "--no-color", str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path: Path) -> None:
    """The lint above can fail: an unpinned base, root at the end and apt without cleanup are caught."""
    hadolint = require_tool("hadolint")
    bad = tmp_path / "bad.Dockerfile"
    bad.write_text("FROM python\nRUN apt-get update && apt-get install -y curl\nUSER root\n")
    proc = subprocess.run([hadolint, "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "DL3006" in proc.stdout and "DL3002" in proc.stdout


def dockerignore_patterns() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]


def ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule for the cases used here: a pattern matches the path or one of its parents
    (`**/` matches any depth)."""
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    for pattern in patterns:
        plain = pattern[3:] if pattern.startswith("**/") else pattern
        for prefix in prefixes:
            if fnmatch.fnmatchcase(prefix, pattern) or fnmatch.fnmatchcase(prefix.rsplit("/", 1)[-1], plain):
                return True
    return False


def copy_sources(dockerfile: Path) -> list[str]:
    sources = []
    for line in dockerfile.read_text().splitlines():
        m = re.match(r"^COPY\s+(?!--from)(.+)$", line.strip())
        if m:
            sources.extend(m.group(1).split()[:-1])
    return sources


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_the_build_context_has_what_the_dockerfile_copies(dockerfile: Path) -> None:
    patterns = dockerignore_patterns()
    sources = copy_sources(dockerfile)
    assert sources
    for src in sources:
        assert (REPO / src).exists(), f"{dockerfile.name} copies {src}, which does not exist"
        assert not ignored(src, patterns), f"{dockerfile.name} copies {src}, which .dockerignore leaves out"
    # What `pip install .` needs: pyproject, its readme, and every package folder it lists.
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    needed = {
        "pyproject.toml",
        project["project"]["readme"],
        *project["tool"]["setuptools"]["packages"]["find"]["where"],
    }
    assert needed <= set(sources), f"{dockerfile.name} does not copy {needed - set(sources)}"


def test_the_dockerignore_keeps_heavy_local_folders_out() -> None:
    patterns = dockerignore_patterns()
    for heavy in (".venv", ".venv-ci", ".tools", ".git", "tests", "engine/dsv4_engine/__pycache__"):
        assert ignored(heavy, patterns), heavy
    assert not ignored("cli/dsv4_cli/main.py", patterns)


def test_the_operator_requirements_leave_out_only_engine_packages() -> None:
    reqs = operator_requirements.operator_requirements(REPO / "pyproject.toml")
    names = {operator_requirements.distribution_name(r) for r in reqs}
    assert {"kopf", "kubernetes-asyncio", "pydantic", "prometheus-client", "typer"} <= names
    assert not names & set(operator_requirements.ENGINE_ONLY)
    assert all("==" in r for r in reqs), "every requirement keeps its pin"


def test_the_operator_runs_without_the_engine_packages() -> None:
    """What the operator image installs is enough: import the operator (and the watchdog it runs)
    and parse `dsv4 operator --help` in a Python where the engine-only packages cannot load."""
    blocked = sorted(m for mods in operator_requirements.ENGINE_ONLY.values() for m in mods)
    script = textwrap.dedent(f"""
        import importlib, pkgutil, sys
        BLOCKED = {blocked!r}

        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ImportError(f"{{name}} is not in the operator image")
                return None

        sys.meta_path.insert(0, Block())
        import dsv4_operator.main
        import dsv4_operator.watchdog
        for mod in pkgutil.iter_modules(dsv4_operator.watchdog.__path__, "dsv4_operator.watchdog."):
            importlib.import_module(mod.name)
        from dsv4_cli.main import app
        try:
            app(["operator", "--help"])
        except SystemExit as e:
            assert e.code == 0, e.code
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
        assert not loaded, loaded
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--standalone" in proc.stdout and "--namespace" in proc.stdout


def test_the_block_is_real() -> None:
    """The check above can fail: importing the engine's model code under the same block does."""
    script = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "torch":
                    raise ImportError("blocked")
        sys.meta_path.insert(0, Block())
        import dsv4_engine.models.deepseek_v3
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode != 0 and "blocked" in proc.stderr
