"""`dsv4 bench faults`: the fault matrix (bench/harness/fault_matrix.py), every fault in every
mode, each cell's expected outcome printed before it runs; a table of the cells as
OUT/faults.json and OUT/faults.png (green: as promised, red: not, grey: not applicable).
Exits 1 when a cell fails.

    python -m bench.suites.faults_bench [--modes mono,pd,pd_structured] [--faults decode_sigkill,...]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Optional

from bench.harness import fault_matrix as fm
from bench.harness.checkpoints import RESULTS, ensure_model
from bench.harness.report import machine, now_iso, pyplot, write_json


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="checkpoint folder (default: the tiny preset)")
    p.add_argument("--modes", default=",".join(fm.MODES))
    p.add_argument("--faults", default=",".join(fm.FAULTS))
    p.add_argument("--out", type=Path, default=RESULTS / "faults")
    a = p.parse_args(argv)
    a.modes = [m for m in a.modes.split(",") if m]
    a.faults = [f for f in a.faults.split(",") if f]
    for m in a.modes:
        if m not in fm.MODES:
            p.error(f"unknown mode {m!r}; known: {', '.join(fm.MODES)}")
    for f in a.faults:
        if f not in fm.FAULTS:
            p.error(f"unknown fault {f!r}; known: {', '.join(fm.FAULTS)}")
    return a


def plot(cells: list[dict], modes: list[str], faults: list[str], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(1.8 + 2.2 * len(modes), 0.9 + 0.6 * len(faults)))
    ax.set_xlim(0, len(modes))
    ax.set_ylim(0, len(faults))
    ax.invert_yaxis()
    by = {(c["fault"], c["mode"]): c for c in cells}
    for y, f in enumerate(faults):
        for x, m in enumerate(modes):
            c = by.get((f, m))
            if c is None or not c["applicable"]:
                color, text = "#dddddd", "n/a"
            else:
                color = "#7ccf7c" if c["passed"] else "#e87c7c"
                text = f"{'pass' if c['passed'] else 'FAIL'} {c['seconds']:.0f}s"
                if c["refused_429"]:
                    text += f"\n{c['refused_429']} x 429"
                if c.get("dropped"):  # no peer (router or dsv4 up killed): ended, then retried
                    text += f"\n{c['dropped']} ended"
            ax.add_patch(plt.Rectangle((x, y), 1, 1, facecolor=color, edgecolor="white"))
            ax.text(x + 0.5, y + 0.5, text, ha="center", va="center", fontsize=8)
    ax.set_xticks([i + 0.5 for i in range(len(modes))], modes)
    ax.set_yticks([i + 0.5 for i in range(len(faults))], faults)
    ax.xaxis.tick_top()
    ax.set_title(
        "dsv4 fault matrix: 0 client errors where a healthy peer exists; with none, streams end at once",
        fontsize=9,
        pad=24,
    )
    fig.tight_layout()
    fig.savefig(path)


def main(argv: Optional[list[str]] = None) -> int:
    a = parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    model = ensure_model(a.model, "tiny", 0)
    started = now_iso()
    with tempfile.TemporaryDirectory(prefix="dsv4-faults-") as tmp:
        cells = fm.run_matrix(model, Path(tmp), a.modes, a.faults)
    report = {
        "suite": "faults",
        "started": started,
        "modes": a.modes,
        "faults": a.faults,
        "streams_per_cell": fm.STREAMS,
        "engine_args": [str(x) for x in fm.ENGINE_ARGS],
        "cells": cells,
        "all_passed": all(c["passed"] for c in cells if c["applicable"]),
        "machine": machine(),
    }
    write_json(report, a.out / "faults.json")
    plot(cells, a.modes, a.faults, a.out / "faults.png")
    for c in cells:
        state = "n/a " if not c["applicable"] else "PASS" if c["passed"] else "FAIL"
        print(f"{state} {c['mode']:14s} {c['fault']:20s} {c['seconds']:6.1f}s  {c['expect']}")
    return 0 if report["all_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
