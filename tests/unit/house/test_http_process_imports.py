"""`dsv4 serve`'s HTTP process never imports torch (nor numpy): its request and output types,
its arguments and its checks live in torch-free modules, and only the engine core process
(`dsv4_serve.engine_core.main`) loads the engine. Checked in a fresh interpreter, since this
test process has torch loaded already. `tests/integration/test_http_process_torch_free.py`
checks the running processes themselves."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import dsv4_serve

HEAVY = ("torch", "numpy")

# What the HTTP process imports: the CLI, every module of dsv4_serve (engine_core included: it
# loads the engine inside main() only), and the light dsv4_engine modules they use.
HTTP_PROCESS_MODULES = [
    "dsv4_cli.main",
    *sorted(f"dsv4_serve.{m.name}" for m in pkgutil.iter_modules([str(Path(dsv4_serve.__file__).parent)])),
    "dsv4_engine",
    "dsv4_engine.engine_args",
    "dsv4_engine.models",
    "dsv4_engine.pd",  # PD roles check a request's bootstrap fields with pd.bootstrap_target
    "dsv4_engine.pd.admission",
    "dsv4_engine.request_output",
    "dsv4_engine.sampling_params",
    "dsv4_engine.tokenizer",
    "dsv4_wire",
]


def test_http_process_modules_import_without_torch_or_numpy():
    code = (
        "import importlib, sys\n"
        f"for name in {HTTP_PROCESS_MODULES!r}:\n"
        "    importlib.import_module(name)\n"
        f"    heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "    assert not heavy, f'importing {name} loaded {heavy}'\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert {"dsv4_serve.app", "dsv4_serve.serving", "dsv4_serve.process", "dsv4_serve.engine_client"} <= set(
        HTTP_PROCESS_MODULES
    )


def test_the_core_process_builds_its_engine_without_the_http_modules():
    """The engine core imports none of the HTTP process's own modules (the app, the OpenAI
    handlers, the process runner) nor FastAPI to build its engine: `engine_core` names them in no
    import, at module level or inside a function."""
    import ast

    import dsv4_serve.engine_core as core

    tree = ast.parse(Path(core.__file__).read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names} | {
        n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
    }
    http = {"dsv4_serve.app", "dsv4_serve.serving", "dsv4_serve.process", "fastapi"}
    assert not names & http, names & http


def test_each_name_is_imported_from_its_home():
    """No module keeps a name alive for the importers of its old home: they import the home."""
    from pathlib import Path

    from dsv4_engine import engine_args
    from dsv4_serve import server_args

    assert issubclass(server_args.ServerArgs, engine_args.EngineArgs)
    repo = Path(__file__).resolve().parents[3]
    shims = [
        f"{p.relative_to(repo)}:{i}"
        for folder in ("engine", "router", "wire")  # engine/ before wire/ and router/ moved out of it
        for p in (repo / folder).rglob("*.py")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if "noqa: F401" in line and ("old home" in line or "re-exported" in line)
    ]
    assert not shims, shims
