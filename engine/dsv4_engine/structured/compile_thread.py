"""Grammars compiled off the engine's step loop, with a deadline (issue 39).

A large grammar (thousands of EBNF rules, a schema whose bounds expand) took seconds to compile
where requests are admitted, on the engine thread: every tenant's batch stalled and /ready could
fail. Compiling runs on a thread of its own (xgrammar releases the GIL while it compiles); its
result, or the deadline passing first, comes back to the engine thread through `post` (the
engine's inbox). A compile that overran keeps its thread until it ends (it cannot be cut short),
and is cached for a later request with the same spec.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

from dsv4_engine.structured.grammar import GrammarCompiler, GrammarError
from dsv4_engine.structured.spec import StructuredSpec

log = logging.getLogger("dsv4.engine")

Done = Callable[[Any, Optional[GrammarError]], None]  # (compiled grammar, or the error)


class CompileThread:
    def __init__(
        self, compiler: Callable[[], GrammarCompiler], post: Callable[[Callable[[], None]], None], deadline_s: float
    ):
        self._make = compiler
        self._compiler: Optional[GrammarCompiler] = None
        self._made = threading.Lock()
        self._post = post
        self.deadline_s = deadline_s
        # two: one slow compile does not hold up every other request's grammar
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar")
        # a spec being compiled -> every request waiting for it: the same spec is compiled once,
        # however many requests bring it before it is done (n > 1, a burst of one agent's tools)
        self._waiting: dict[StructuredSpec, list[Done]] = {}
        self._waiting_lock = threading.Lock()
        self._joined = 0

    @property
    def compiler(self) -> GrammarCompiler:
        with self._made:
            if self._compiler is None:  # built on first use (the vocabulary's table takes a while)
                self._compiler = self._make()
            return self._compiler

    @property
    def hits(self) -> int:
        """Requests whose grammar was compiled for another: the cache's hits and those that
        joined a compile in flight."""
        return (self._compiler.hits if self._compiler is not None else 0) + self._joined

    def cached(self, spec: StructuredSpec) -> Any:
        """The compiled grammar if this spec was compiled before (engine thread), else None."""
        return self._compiler.cached(spec) if self._compiler is not None else None

    def start(self, spec: StructuredSpec, done: Done) -> None:
        """Compile `spec`; `done` runs on the engine thread exactly once: with the grammar, with
        its GrammarError, or with a GrammarError when the deadline passes first. A spec already
        being compiled is not compiled again: `done` waits for that compile's answer."""
        with self._waiting_lock:
            if spec in self._waiting:
                self._waiting[spec].append(done)
                self._joined += 1
                return
            self._waiting[spec] = [done]
        lock, answered = threading.Lock(), [False]

        def answer(compiled: Any, error: Optional[GrammarError]) -> None:
            with lock:
                if answered[0]:
                    return
                answered[0] = True
            timer.cancel()
            with self._waiting_lock:
                waiters = self._waiting.pop(spec, [])
            for d in waiters:
                self._post(lambda d=d: d(compiled, error))

        def work() -> None:
            try:
                compiled = self.compiler.compile(spec)
            except GrammarError as e:
                return answer(None, e)
            except Exception as e:  # noqa: BLE001 — the request fails, never the thread
                log.error("compiling a %s grammar failed: %r", spec.kind, e)
                return answer(None, GrammarError(f"{spec.kind}: the grammar could not be compiled"))
            answer(compiled, None)

        timer = threading.Timer(
            self.deadline_s,
            lambda: answer(
                None,
                GrammarError(
                    f"{spec.kind}: the grammar did not compile within {self.deadline_s:g} s "
                    "(simplify it: fewer rules, smaller repeat counts)"
                ),
            ),
        )
        timer.daemon = True
        timer.start()
        self._pool.submit(work)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
