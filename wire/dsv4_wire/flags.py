"""`dsv4 serve` flags that other parts write on a command line (the operator's manifests,
`dsv4 up`, benchmarks), spelled from their one declaration (serve_options): `EngineFlags.PORT`
is "--port", `EngineFlags.NO_DEADLINES` is "--no-deadlines"."""

from __future__ import annotations

from dsv4_wire.router_options import ROUTER_OPTIONS
from dsv4_wire.serve_options import SERVE_OPTIONS

EngineFlags = type("EngineFlags", (), {o.constant: o.cli_flag for o in SERVE_OPTIONS if o.cli})

# `dsv4 router` flags, likewise (dsv4_wire.router_options): `RouterFlags.DISCOVER_NAMESPACE`.
RouterFlags = type("RouterFlags", (), {o.constant: o.cli_flag for o in ROUTER_OPTIONS if o.cli})
