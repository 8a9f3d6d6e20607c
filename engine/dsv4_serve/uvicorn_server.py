"""uvicorn's server without its own signal handling: `process` drains on SIGTERM first, and the
engine core's bootstrap server leaves signals to the HTTP process."""

from __future__ import annotations

import contextlib

import uvicorn


class UvicornServer(uvicorn.Server):
    """uvicorn without its own SIGTERM/SIGINT handling: `process.run_server` drains first."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield
