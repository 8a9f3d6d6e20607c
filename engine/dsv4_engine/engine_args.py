"""What an engine is built from (`Engine(EngineArgs(...))`).

Plain data, no torch. The fields, their defaults and their meaning are the "engine" options of
`dsv4_wire.serve_options` (the one declaration of every `dsv4 serve` option);
`dsv4_serve.server_args.ServerArgs` extends it with the server's and PD's.
"""

from __future__ import annotations

import os

from dsv4_wire.options import dataclass_of
from dsv4_wire.serve_options import SERVE_OPTIONS


def _resolve(self) -> None:
    if self.served_model_name is None:  # the name in /v1/models and in the metrics' labels
        self.served_model_name = os.path.basename(os.path.normpath(self.model)) or "dsv4"


EngineArgs = dataclass_of(
    "EngineArgs",
    SERVE_OPTIONS,
    ["engine"],
    doc="The engine options of dsv4_wire.serve_options.",
    namespace={"__post_init__": _resolve, "__module__": __name__},
)
