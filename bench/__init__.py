"""dsv4's benchmarks, a package of the source checkout (not of the wheel).

- `bench.harness`: what the benchmarks (and the tests) drive dsv4 with: real processes, the load
  generator, the Prometheus reader, the report writer, checkpoints, the emulated Kubernetes API
  server, the operator in a thread, the chaos clusters.
- `bench.suites`: the standing benchmarks; `dsv4 bench NAME` runs the ones behind the CLI.
- `bench.experiments`: one-off A/Bs, kept with the results they produced.

Run one from the checkout's root as a module, e.g. `python -m bench.suites.serve_bench --quick`
(or through `dsv4 bench serve --quick`). Nothing here edits `sys.path`: the checkout's root is
on it when Python runs from there (`-m`), through pytest's `pythonpath` setting, or through
`PYTHONPATH` for the child processes a benchmark starts (`module_env`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Mapping, Optional

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent  # the source checkout
RESULTS = BENCH / "results"


def module_argv(module: str, *args: object) -> list[str]:
    """The command line that runs a module of this package in a child Python."""
    return [sys.executable, "-m", module, *map(str, args)]


def module_env(env: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """An environment in which `python -m bench...` finds this checkout, from any directory."""
    out = dict(os.environ if env is None else env)
    out["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), out.get("PYTHONPATH", "")) if p)
    return out
