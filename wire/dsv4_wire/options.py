"""Command-line options declared once: name, flag, type, default, help and range.

A command's options are a table of `Option`s (serve_options for `dsv4 serve`, router_options
for `dsv4 router`); the dataclass a command fills (EngineArgs, ServerArgs, RouterArgs) is made
from the table (`dataclass_of`), and so are its typer parameters (dsv4_cli.options) and the flag
names other parts write (EngineFlags). Scope "command": an input of the command alone that
becomes another field (a secret's file, a list of key files).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

REQUIRED = ...  # the default of an option that must be given (--model)


@dataclass(frozen=True)
class Option:
    name: str  # the dataclass field (or, scope "command", the command's parameter)
    type: type  # of one value: str, int, float, bool; a list option repeats its flag
    default: Any
    help: str = ""
    scope: str = "engine"  # a dataclass's share of a table (serve: engine | server), or "command"
    flag: str = ""  # default: --name-with-dashes; a bool that defaults to True: the flag turns it off
    min: Optional[float] = None
    choices: tuple[str, ...] = ()
    envvar: Optional[str] = None
    repeat: bool = False  # a list: the flag may be given again for each value
    cli: bool = True  # False: a field the command fills from other options (api_keys)

    @property
    def cli_flag(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")

    @property
    def constant(self) -> str:
        """The flag's name as a constant: --no-deadlines -> NO_DEADLINES."""
        return self.cli_flag[2:].replace("-", "_").upper()

    def field(self) -> tuple[str, Any, Any]:
        """(name, annotation, dataclasses.field) for dataclasses.make_dataclass."""
        if self.repeat or self.type is list:
            return self.name, list, dataclasses.field(default_factory=lambda d=tuple(self.default): list(d))
        if self.default is REQUIRED:
            return self.name, self.type, dataclasses.field()
        annotation = self.type if self.default is not None else Optional[self.type]
        return self.name, annotation, dataclasses.field(default=self.default)


def secret(name: str, help: str, scope: str, envvar: str) -> tuple[Option, Option]:
    """A secret option and its file twin (`--admin-token` / `--admin-token-file`, with the
    environment variables NAME and NAME_FILE): a mounted Kubernetes Secret is a file, and argv is
    visible to every user. The command reads the file into the field (scope "command")."""
    value = Option(name, str, None, help, scope=scope, envvar=envvar)
    twin = Option(
        f"{name}_file",
        str,
        None,
        f"File holding the value of {value.cli_flag}.",
        scope="command",
        envvar=envvar + "_FILE",
    )
    return value, twin


def in_scopes(table: Sequence[Option], *scopes: str) -> list[Option]:
    return [o for o in table if o.scope in scopes]


def dataclass_of(
    cls_name: str,
    table: Sequence[Option],
    scopes: Iterable[str],
    bases: tuple = (),
    doc: str = "",
    namespace: Optional[dict] = None,
) -> type:
    """A dataclass whose fields are the options of `scopes` (those of `bases` excluded), in the
    declared order; required ones first, as dataclasses need."""
    inherited = {f.name for b in bases for f in dataclasses.fields(b)}
    chosen = [o for o in in_scopes(table, *scopes) if o.name not in inherited]
    chosen.sort(key=lambda o: o.default is not REQUIRED)  # stable: the declared order otherwise
    return dataclasses.make_dataclass(
        cls_name, [o.field() for o in chosen], bases=bases, namespace=dict(namespace or {}, __doc__=doc)
    )
