"""A typer command's parameters made from option declarations (dsv4_wire.options), so that
a flag's name, default, help and range are written once, where the option is declared."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Iterable, List, Mapping, Optional

import typer

from dsv4_wire.options import REQUIRED, Option


def _parameter(o: Option) -> inspect.Parameter:
    if o.type is bool:  # a switch: it turns on what is off by default, or off what is on
        annotation, info = bool, typer.Option(False, o.cli_flag, help=o.help)
    elif o.repeat:
        annotation, info = (
            List[o.type],
            typer.Option([], o.cli_flag, help=o.help, envvar=o.envvar, metavar=f"<{o.type.__name__}>"),
        )
    else:
        annotation = o.type if o.default is not None else Optional[o.type]
        info = typer.Option(
            o.default,
            o.cli_flag,
            help=o.help,
            min=o.min,
            envvar=o.envvar,
            show_default=o.default not in (None, REQUIRED),
        )
    return inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=annotation)


def command(opts: Iterable[Option], fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn(**given)` with a signature typer reads as one parameter per option that has a flag."""
    fn.__signature__ = inspect.Signature([_parameter(o) for o in opts if o.cli])  # type: ignore[attr-defined]
    return fn


def choice_error(opts: Iterable[Option], given: Mapping[str, Any]) -> Optional[str]:
    """Pure: the first value outside its option's choices, as one line."""
    for o in opts:
        value = given.get(o.name)
        if o.choices and value is not None and value not in o.choices:
            return f"{o.cli_flag} must be one of {', '.join(o.choices)}, not {value!r}"
    return None


def field_values(opts: Iterable[Option], given: Mapping[str, Any]) -> dict[str, Any]:
    """Pure: the dataclass fields the command line gives (scopes engine and server): a switch
    of an option that is on by default turns it off; repeated flags become lists."""
    out: dict[str, Any] = {}
    for o in opts:
        if o.scope == "command" or not o.cli or o.name not in given:
            continue
        value = given[o.name]
        if o.type is bool and o.default is True:
            value = not value
        elif o.repeat:
            value = list(value or [])
        out[o.name] = value
    return out
