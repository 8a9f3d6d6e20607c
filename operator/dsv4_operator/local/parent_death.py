"""`dsv4 up`'s children end with it, even when it is killed with no chance to stop them
(SIGKILL, an OOM kill): each child asks the kernel for a SIGKILL when its parent dies (Linux's
PR_SET_PDEATHSIG), and a restarted `dsv4 up` finds its ports free. SIGKILL, not SIGTERM: with
no supervisor and no peer left, a drain would only hold the clients' streams open (a
SIGTERMed router and engines kept them a minute); killed, their connections close at once and
an engine's core and ranks follow it (they watch their parent). Elsewhere the call is a no-op
(the orderly stop still stops them)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import Callable, Optional

PR_SET_PDEATHSIG = 1


def term_with_parent() -> Optional[Callable[[], None]]:
    """A `preexec_fn` for subprocess.Popen (run in the child before exec), or None where the
    kernel has no such request. The parent must start children from a thread that lives as
    long as it does: the signal follows the thread that forked (dsv4 up starts them on its
    event loop's thread)."""
    if not sys.platform.startswith("linux"):
        return None
    parent = os.getpid()
    libc = ctypes.CDLL(None, use_errno=True)

    def preexec() -> None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # it died between fork and prctl: nobody will send it
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec
