"""Each `dsv4 serve` and `dsv4 router` option is declared once (dsv4_wire.serve_options,
dsv4_wire.router_options): the dataclasses, the CLI, EngineFlags, PDSettings and `dsv4 up` are
made from that declaration, and no other source spells
one of its defaults again (a parameter or field of the same name whose literal default is the
declared one). Neutral values (False, 0, 1: a switch off, no TP) say "without this setting" in an
internal signature and are not counted; None never is."""

from __future__ import annotations

import ast
from dataclasses import fields
from pathlib import Path

from typer.testing import CliRunner

from dsv4_cli.main import app
from dsv4_engine.engine_args import EngineArgs
from dsv4_engine.pd.common import PDSettings
from dsv4_operator.local.up import ENGINE_DEADLINES
from dsv4_router.router_args import RouterArgs
from dsv4_serve.server_args import ServerArgs
from dsv4_wire import EngineFlags
from dsv4_wire.router_options import ROUTER_OPTIONS, ROUTER_OPTIONS_BY_NAME, router_options
from dsv4_wire.serve_options import OPTIONS_BY_NAME, PD_DEADLINES, REQUIRED, SERVE_OPTIONS, options

REPO = Path(__file__).resolve().parents[3]
DECLARATIONS = {REPO / "wire" / "dsv4_wire" / f for f in ("serve_options.py", "router_options.py")}
# Names other settings share (a router's port, a sampling seed): a same-named literal elsewhere
# is another setting, not this one's default written twice.
SHARED_NAMES = {"model", "role", "host", "port", "seed", "device", "dtype", "api_keys", "admin_token", "pd_secret"}


def test_the_dataclasses_are_the_declared_options() -> None:
    engine = {f.name: f for f in fields(EngineArgs)}
    server = {f.name: f for f in fields(ServerArgs)}
    assert set(engine) == {o.name for o in options("engine")}
    assert set(server) == {o.name for o in options("engine", "server")}
    args = ServerArgs(model="/m/ckpt")
    for o in options("engine", "server"):
        if o.default is REQUIRED or o.name in ("served_model_name", "bootstrap_port"):
            continue
        assert getattr(args, o.name) == (list(o.default) if o.repeat or o.type is list else o.default), o.name
    assert args.served_model_name == "ckpt" and args.bootstrap_port == args.port + 1000
    assert ServerArgs(model="m", port=9000, bootstrap_port=1234).bootstrap_port == 1234


def test_router_args_are_the_declared_router_options() -> None:
    assert {f.name for f in fields(RouterArgs)} == {o.name for o in router_options("router")}
    args = RouterArgs(key_rate_limit=2.0)
    assert args.max_inflight == ROUTER_OPTIONS_BY_NAME["max_inflight"].default and args.prefill == []
    assert args.key_limits.rate == 2.0 and args.key_limits.bucket == 2.0
    result = CliRunner().invoke(app, ["router", "--help"], terminal_width=200)
    assert all(o.cli_flag in result.output for o in ROUTER_OPTIONS if o.cli), result.output


def test_the_pd_deadlines_everywhere_are_the_declared_ones() -> None:
    pd = PDSettings()
    for name in PD_DEADLINES:
        o = OPTIONS_BY_NAME[name]
        assert getattr(pd, name) == o.default and ENGINE_DEADLINES[o.cli_flag] == o.default


def test_every_flag_of_dsv4_serve_is_declared_and_spelled_by_engine_flags() -> None:
    result = CliRunner().invoke(app, ["serve", "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    for o in SERVE_OPTIONS:
        if o.cli:
            assert o.cli_flag in result.output, o.cli_flag
            assert getattr(EngineFlags, o.constant) == o.cli_flag
    assert EngineFlags.NO_DEADLINES == "--no-deadlines" and EngineFlags.DISABLE_PREFIX_CACHE == "--disable-prefix-cache"


def _literal_defaults(tree: ast.AST):
    """(name, value, line) of every parameter and class-level annotated field with a literal default."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            positional = a.posonlyargs + a.args
            pairs = list(zip(positional[len(positional) - len(a.defaults) :], a.defaults))
            pairs += [(arg, d) for arg, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
            for arg, d in pairs:
                if isinstance(d, ast.Constant) and d.value is not None:
                    yield arg.arg, d.value, node.lineno
        elif isinstance(node, ast.ClassDef):
            for stmt in node.body:
                if (
                    isinstance(stmt, ast.AnnAssign)
                    and isinstance(stmt.target, ast.Name)
                    and isinstance(stmt.value, ast.Constant)
                    and stmt.value.value is not None
                ):
                    yield stmt.target.id, stmt.value.value, stmt.lineno


def _neutral(value: object) -> bool:
    return value is False or (type(value) is int and value in (0, 1))


def test_no_option_default_is_spelled_twice() -> None:
    watched = {
        o.name: o.default
        for o in (*SERVE_OPTIONS, *ROUTER_OPTIONS)
        if o.name not in SHARED_NAMES and o.default not in (None, REQUIRED) and not _neutral(o.default)
    }
    found = []
    for root in ("cli", "engine", "operator", "router", "wire"):
        for path in (REPO / root).rglob("*.py"):
            if path in DECLARATIONS:
                continue
            for name, value, line in _literal_defaults(ast.parse(path.read_text(), str(path))):
                if name in watched and value == watched[name] and type(value) is type(watched[name]):
                    found.append(f"{path.relative_to(REPO)}:{line}: {name}")
    assert not found, "defaults of dsv4 serve options written outside dsv4_wire.serve_options:\n" + "\n".join(found)
