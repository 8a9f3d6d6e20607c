"""The user docs name only what exists (issue 43): every `dsv4 ...` command line in README.md, docs/,
crds/README.md and the chart's README names a real command and only flags that command takes;
every flag named on its own (`--flag`) is a flag of some `dsv4` command (or of a tool the docs name,
listed below); every CRD field path (`spec.x.y`, or `engine.args` under a top-level spec field)
and chart value (`watch.scope`) is in the CRD's schema or the chart's values; every relative
link resolves to a file of the repository."""

from __future__ import annotations

import functools
import re
import shlex
from pathlib import Path
from typing import Iterator

import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]
DOCS = sorted(
    [REPO / "README.md", REPO / "crds" / "README.md", REPO / "charts" / "dsv4-operator" / "README.md"]
    + list((REPO / "docs").glob("*.md"))
)

# Flags of other tools the docs name on their own (helm's, sgl-router's): checked nowhere here,
# listed one by one so that a typo of ours is not taken for one of theirs.
FOREIGN_FLAGS = {"--set", "--pd-disaggregation", "--service-discovery"}


def rel(doc: Path) -> str:
    return str(doc.relative_to(REPO)) if doc.is_relative_to(REPO) else doc.name


@functools.lru_cache(maxsize=None)
def cli_tree() -> dict[tuple[str, ...], set[str]]:
    """Command path -> its flags, read from the `dsv4` app itself."""
    import typer

    from dsv4_cli.main import app

    out: dict[tuple[str, ...], set[str]] = {}

    def walk(cmd, path: tuple[str, ...]) -> None:
        flags = {"--help"}
        for p in cmd.params:
            flags.update(o for o in (*p.opts, *p.secondary_opts) if o.startswith("-"))
        out[path] = flags
        for name, sub in (getattr(cmd, "commands", None) or {}).items():
            walk(sub, (*path, name))

    walk(typer.main.get_command(app), ())
    return out


BENCH_SUITES_DIR = REPO / "bench" / "suites"


@functools.lru_cache(maxsize=None)
def argparse_flags(path: Path) -> frozenset[str]:
    """The flags a script's argparse declares (`add_argument("--x", ...)`), read from its source."""
    return frozenset(re.findall(r"add_argument\(\s*(?:\"-[a-z]\",\s*)?\"(--[a-z][a-z0-9-]*)\"", path.read_text()))


def command_flags(path: tuple[str, ...]) -> set[str]:
    """A command's flags; `dsv4 bench NAME` hands its arguments to its suite's own parser."""
    flags = set(cli_tree()[path])
    if len(path) == 2 and path[0] == "bench":
        from dsv4_cli.bench import SUITES

        flags |= argparse_flags(BENCH_SUITES_DIR / f"{SUITES[path[1]][0]}.py")
    return flags


def all_flags() -> set[str]:
    scripts = [*(REPO / "bench").rglob("*.py"), *(REPO / "scripts").glob("*.py")]
    return set().union(*cli_tree().values(), *(argparse_flags(p) for p in scripts))


def code_texts(text: str) -> Iterator[str]:
    """Every code block line and every inline code span of a markdown text."""
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S):
        yield from block.replace("\\\n", " ").splitlines()
    prose = re.sub(r"```[a-z]*\n.*?```", "", text, flags=re.S)
    yield from re.findall(r"`([^`\n]+)`", prose)


def dsv4_command_lines(text: str) -> Iterator[str]:
    for code in code_texts(text):
        for m in re.finditer(r"(?:^|[\s($])dsv4 ([a-z][^|;&#)]*)", code):
            yield "dsv4 " + m.group(1).strip()


def resolve(argv: list[str]) -> tuple[tuple[str, ...], list[str]]:
    """The longest command path the words start with, and the words after it."""
    tree, path = cli_tree(), ()
    rest = argv[1:]
    while rest and (*path, rest[0]) in tree:
        path, rest = (*path, rest[0]), rest[1:]
    return path, rest


def findings_commands() -> list[str]:
    bad = []
    for doc in DOCS:
        for line in dsv4_command_lines(doc.read_text()):
            try:
                argv = shlex.split(line)
            except ValueError:
                argv = line.split()
            path, rest = resolve(argv)
            if not path:
                bad.append(f"{rel(doc)}: `{line}`: no such command")
                continue
            for word in rest:
                flag = word.split("=", 1)[0]
                if (
                    flag.startswith("--")
                    and re.fullmatch(r"--[a-z][a-z0-9-]*", flag)
                    and flag not in command_flags(path)
                ):
                    bad.append(f"{rel(doc)}: `{line}`: dsv4 {' '.join(path)} has no {flag}")
    return bad


def findings_flags() -> list[str]:
    bad, known = [], all_flags() | FOREIGN_FLAGS
    for doc in DOCS:
        for code in code_texts(doc.read_text()):
            if "dsv4 " in code or code.lstrip().startswith(("python", "vllm", "sglang", "kubectl", "helm", "pip")):
                continue  # whole command lines are checked per command above, or are another tool's
            m = re.fullmatch(r"\s*(--[a-z][a-z0-9-]*)(?:[ =].*)?", code)
            if m and m.group(1) not in known:
                bad.append(f"{rel(doc)}: `{code}`: no dsv4 command has {m.group(1)}")
    return bad


@functools.lru_cache(maxsize=None)
def crd_spec_schema() -> dict:
    crd = yaml.safe_load((REPO / "crds" / "dsv4deployment.yaml").read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


@functools.lru_cache(maxsize=None)
def chart_values() -> dict:
    return yaml.safe_load((REPO / "charts" / "dsv4-operator" / "values.yaml").read_text())


def schema_has(node: dict, parts: list[str]) -> bool:
    for part in parts:
        part = part.split("[", 1)[0]
        while node.get("type") == "array" and "items" in node:
            node = node["items"]
        if node.get("x-kubernetes-preserve-unknown-fields") and "properties" not in node:
            return True
        props = node.get("properties") or {}
        if part in props:
            node = props[part]
        elif isinstance(node.get("additionalProperties"), dict):
            node = node["additionalProperties"]
        else:
            return False
    return True


def values_have(values: object, parts: list[str]) -> bool:
    for part in parts:
        if not isinstance(values, dict):
            return values is None  # a free-form value (null default, a map of the user's)
        if part not in values:
            return values == {}  # a map left empty by default (labels, annotations)
        values = values[part]
    return True


FIELD = re.compile(r"[a-z][a-zA-Z0-9]*(?:\.[a-z][a-zA-Z0-9]*(?:\[\])?)+")
# Dotted names that are neither fields nor values: files, modules, metrics, labels, hosts.
NOT_A_FIELD = re.compile(
    r"\.(md|py|yaml|yml|json|sh|txt|toml|c|so|png|html|safetensors|io|com|dev|org|local|svc)\b"
    r"|^(dsv4_|dsv4\.|serving\.|app\.|nvidia\.|kubernetes\.|torch\.|np\.|self\.|os\.|sys\.)"
)


@functools.lru_cache(maxsize=None)
def span_names() -> frozenset[str]:
    """Tracing span names (`router.request`, `engine.prefill`, ...): dotted, but not fields."""
    found: set[str] = set()
    for folder in ("router", "engine", "wire"):
        for p in (REPO / folder).rglob("*.py"):
            found.update(re.findall(r"\"((?:router|engine)\.[a-z_]+)\"", p.read_text()))
    return frozenset(found)


def findings_fields() -> list[str]:
    schema = crd_spec_schema()
    top_spec = set(schema["properties"]["spec"]["properties"])
    top_values = set(chart_values())
    bad = []
    for doc in DOCS:
        for code in code_texts(doc.read_text()):
            token = code.strip().split(":")[0].split("=")[0].strip()
            if not FIELD.fullmatch(token) or NOT_A_FIELD.search(token) or token in span_names():
                continue
            parts = token.replace("[]", "").split(".")
            if parts[0] in ("spec", "status"):
                ok = schema_has(schema, parts)
            elif parts[0] in top_spec:
                ok = schema_has(schema["properties"]["spec"], parts)
            elif parts[0] in top_values:
                ok = values_have(chart_values(), parts)
            else:
                continue
            if not ok:
                bad.append(f"{rel(doc)}: `{code}`: no such field")
    return bad


def findings_links() -> list[str]:
    bad = []
    for doc in DOCS:
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
        text = re.sub(r"`[^`\n]+`", "", text)  # code spans (regular expressions) hold no links
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = (doc.parent / target.split("#", 1)[0]).resolve()
            if not path.exists() or not path.is_relative_to(REPO.resolve()):
                bad.append(f"{rel(doc)}: link to {target} resolves to nothing in the repository")
    return bad


@pytest.mark.parametrize("check", [findings_commands, findings_flags, findings_fields, findings_links])
def test_docs_name_only_what_exists(check) -> None:
    bad = check()
    assert not bad, "\n".join(bad)


def test_the_checks_can_fail(tmp_path: Path) -> None:
    doc = tmp_path / "bad.md"
    doc.write_text(
        "Run `dsv4 serve --no-such-flag` or `dsv4 teleport`; set `engine.extraArgs` and `watch.scopes`;\n"
        "pass `--kv-memory-gbs 4`; read [this](missing.md).\n"
    )
    globals()["DOCS"], saved = [doc], DOCS
    try:
        found = findings_commands() + findings_flags() + findings_fields() + findings_links()
    finally:
        globals()["DOCS"] = saved
    text = "\n".join(found)
    for expected in ("--no-such-flag", "teleport", "engine.extraArgs", "watch.scopes", "--kv-memory-gbs", "missing.md"):
        assert expected in text, (expected, text)


def test_the_readme_test_command_is_what_ci_runs() -> None:
    """README's "Run the tests" block is the test line of .ci/run, word for word."""
    readme = (REPO / "README.md").read_text()
    block = readme.split("## Run the tests", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0].strip()
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines() if "pytest" in line]
    assert ci and block == ci[-1], (block, ci)
