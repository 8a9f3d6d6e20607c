"""`dsv4 up`'s processes die with it: a process EngineProc started outlives no `kill -9` of the
process that started it (dsv4_operator.local.parent_death). Before, a killed `dsv4 up` left its
router and engines holding their ports, and the next `dsv4 up` could not start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

PARENT = """
import sys, time
from pathlib import Path
from dsv4_operator.local.supervisor import EngineProc
p = EngineProc("decode-0", "decode", 1, [sys.executable, "-c", "import time; time.sleep(60)"], Path(sys.argv[1]))
p.start()
print(p.popen.pid, flush=True)
time.sleep(60)
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_supervised_process_dies_with_its_parent(tmp_path):
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tmp_path / "child.log")], stdout=subprocess.PIPE, env=os.environ
    )
    child = int(parent.stdout.readline())
    try:
        assert not _gone(child)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 10
        while not _gone(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(child), "the child outlived the process that started it"
    finally:
        if not _gone(child):
            os.kill(child, signal.SIGKILL)
