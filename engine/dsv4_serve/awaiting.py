"""Requests the HTTP process holds that have had no output from the engine core yet: being
tokenised, on their way to the core, or waiting there. With the core idle, such requests are a
hang nobody else sees (a tokenizer queue overflowing, a lost hand-over: /health stays green);
the watchdog reads the count as `dsv4:num_http_waiting_reqs` (issue 45).

Each request holds one `Held` from its arrival until its first output or its end. A held request
whose handler never ran to its end (a stream never iterated) is dropped with it: the count is of
the live ones, so a leak can never read as a hang."""

from __future__ import annotations

import weakref


class Held:
    __slots__ = ("open", "__weakref__")

    def __init__(self) -> None:
        self.open = True

    def release(self) -> None:
        self.open = False


class Awaiting:
    def __init__(self) -> None:
        self._held: "weakref.WeakSet[Held]" = weakref.WeakSet()

    def enter(self) -> Held:
        h = Held()
        self._held.add(h)
        return h

    @property
    def count(self) -> int:
        return sum(1 for h in list(self._held) if h.open)


def http_waiting_metric(count: int, role: str, model_name: str) -> str:
    """The gauge's Prometheus text, appended to the core's page by the HTTP process."""
    from dsv4_wire.metrics import HTTP_GAUGES, metric_name

    name = metric_name("num_http_waiting_reqs")
    return (
        f"# HELP {name} {HTTP_GAUGES['num_http_waiting_reqs']}\n# TYPE {name} gauge\n"
        f'{name}{{model_name="{model_name}",role="{role}"}} {count}\n'
    )
