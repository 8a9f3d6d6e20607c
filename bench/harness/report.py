"""What every benchmark writes: the JSON record (with the machine's state at the time), ratios
that tolerate a missing side, and the PNG (matplotlib, Agg: no display here)."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
from pathlib import Path
from typing import Optional

from bench.harness.procs import load_average


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    if a is None or b is None or b == 0:
        return None
    return round(a / b, 3)


def fmt(x, unit: str = "", digits: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:,.{digits}f}{unit}"
    return f"{x}{unit}"


def fmt_ratio(x: Optional[float], target: Optional[float] = None, higher_better: bool = True) -> str:
    if x is None:
        return "-"
    s = f"{x:.2f}x"
    if target is None:
        return s
    ok = x >= target if higher_better else x <= target
    return f"[green]{s}[/green]" if ok else f"[red]{s}[/red]"


def mib(n: Optional[float]) -> Optional[float]:
    return None if n is None else round(n / (1 << 20), 1)


def machine() -> dict:
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "load_average_start": load_average(),
    }


def target(name: str, value: Optional[float], goal: float, higher_better: bool = True) -> dict:
    met = None if value is None else (value >= goal if higher_better else value <= goal)
    return {"name": name, "value": value, "target": f"{'>=' if higher_better else '<='} {goal}", "met": met}


def write_json(report: dict, path: Path) -> None:
    report.setdefault("machine", machine())
    report["machine"]["load_average_end"] = load_average()
    report["finished"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def grouped_bars(
    ax,
    groups: list[str],
    series: dict[str, list[Optional[float]]],
    title: str,
    ylabel: str,
    colors: Optional[dict[str, str]] = None,
) -> None:
    """One bar per series in each group; a missing value leaves a gap (and says n/a). `colors`
    keeps a side's colour the same in every panel."""
    n = max(1, len(series))
    width = 0.8 / n
    for k, (label, values) in enumerate(series.items()):
        xs = [i + (k - (n - 1) / 2) * width for i in range(len(groups))]
        ys = [v if v is not None else 0.0 for v in values]
        bars = ax.bar(xs, ys, width, label=label, color=(colors or {}).get(label))
        for b, v in zip(bars, values):
            ax.annotate(
                "n/a" if v is None else f"{v:,.0f}" if v >= 10 else f"{v:.2f}",
                (b.get_x() + b.get_width() / 2, b.get_height()),
                ha="center",
                va="bottom",
                fontsize=7,
            )
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups)
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
