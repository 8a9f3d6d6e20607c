"""Everything `dsv4 serve` takes: the engine's arguments plus the server's and PD's.

A dataclass made from the "engine" and "server" options of `dsv4_wire.serve_options` (their one
declaration); light (no FastAPI, no torch), so that the CLI can build its command from it.
"""

from __future__ import annotations

from dataclasses import fields

from dsv4_engine.engine_args import EngineArgs
from dsv4_wire.options import dataclass_of
from dsv4_wire.serve_options import SERVE_OPTIONS


def _resolve(self) -> None:
    EngineArgs.__post_init__(self)
    if self.bootstrap_port is None:
        self.bootstrap_port = self.port + 1000


def _engine_args(self) -> EngineArgs:
    """The engine's share of the arguments (what the engine core builds its engine from)."""
    return EngineArgs(**{f.name: getattr(self, f.name) for f in fields(EngineArgs)})


ServerArgs = dataclass_of(
    "ServerArgs",
    SERVE_OPTIONS,
    ["engine", "server"],
    bases=(EngineArgs,),
    doc="The engine and server options of dsv4_wire.serve_options.",
    namespace={"__post_init__": _resolve, "engine_args": _engine_args, "__module__": __name__},
)
