"""Start the engine core process early: light to import (no torch), so `dsv4 serve` can start
its child first and let it import torch and the model code while the HTTP process imports its
own; the core waits for its arguments (INIT) before it loads anything. A parent that gives up
before sending them (a bad flag) just closes the channel, and the child exits quietly."""

from __future__ import annotations

import socket
import subprocess
import sys
from multiprocessing.connection import Connection


def spawn_core() -> tuple[subprocess.Popen, Connection]:
    """The core process, not yet told what to serve, and our end of its channel."""
    ours, theirs = socket.socketpair()
    cmd = [sys.executable, "-m", "dsv4_serve.engine_core", str(theirs.fileno())]
    proc = subprocess.Popen(cmd, pass_fds=(theirs.fileno(),))
    theirs.close()
    return proc, Connection(ours.detach())
