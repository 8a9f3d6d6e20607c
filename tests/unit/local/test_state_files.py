"""`dsv4 up`'s state files are read by people and scripts while it rewrites them: a reader must
see the old content or the new, never an empty or half-written file."""

from __future__ import annotations

import json
import os
import stat
import threading

from dsv4_operator.local.up import stored_secret
from dsv4_operator.local.state_files import write_atomic


def test_a_reader_in_a_tight_loop_never_meets_a_torn_file(tmp_path):
    path = tmp_path / "processes.json"
    write_atomic(path, json.dumps({"n": 0}))
    torn: list[str] = []
    done = threading.Event()

    def reader() -> None:
        while not done.is_set():
            text = path.read_text()
            try:
                json.loads(text)
            except ValueError:
                torn.append(text)

    t = threading.Thread(target=reader)
    t.start()
    try:
        for n in range(3000):  # large enough that a plain truncate-then-write is caught mid-way
            write_atomic(path, json.dumps({"n": n, "pad": "x" * (n % 4096)}))
    finally:
        done.set()
        t.join()
    assert torn == []
    assert json.loads(path.read_text())["n"] == 2999
    assert [p.name for p in tmp_path.iterdir()] == ["processes.json"]  # no temporary left behind


def test_secrets_stay_private(tmp_path):
    path = tmp_path / "pd-secret"
    value = stored_secret(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stored_secret(path) == value
    os.chmod(path, 0o644)  # readable by others: it may have leaked, so it is made anew
    assert stored_secret(path) != value and stat.S_IMODE(path.stat().st_mode) == 0o600
