"""The pure rules of `dsv4 up`: crash-loop backoff, the detection window against the engines'
deadlines, secrets on disk, and startup lines that never break a path."""

from __future__ import annotations

import io
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from dsv4_wire import EngineFlags as F
from dsv4_operator.local import up as local
from dsv4_operator.local.up import (
    ENGINE_DEADLINES,
    NO_DEADLINES_WINDOW_S,
    WINDOW_MARGIN_S,
    LocalDeployment,
    UpArgs,
    WindowTooShort,
    detection_window,
    engine_deadlines,
    stored_secret,
)
from dsv4_operator.local.supervisor import CrashBackoff, EngineProc, Supervisor


# ---- crash-loop backoff ------------------------------------------------------------------------


def test_first_crash_restarts_at_once_then_doubles_to_the_cap() -> None:
    b = CrashBackoff(first_s=1.0, cap_s=30.0, stable_s=60.0)
    assert [b.delay(n) for n in range(1, 9)] == [0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]


def test_a_stable_run_starts_the_count_again() -> None:
    b = CrashBackoff(stable_s=60.0)
    assert b.crashes_after(0, 0.5) == 1
    assert b.crashes_after(5, 3.0) == 6  # crash-looping: it keeps growing
    assert b.crashes_after(5, 60.0) == 1  # ran long enough: this crash is the first of a new run
    assert b.delay(b.crashes_after(7, 3600.0)) == 0.0


def _proc(tmp_path: Path, key: str, code: str) -> EngineProc:
    return EngineProc(key, "decode", 0, [sys.executable, "-c", code], tmp_path / f"{key}.log")


def test_supervisor_restarts_a_dead_process_by_its_schedule(tmp_path) -> None:
    events: list[tuple[str, str, str]] = []
    p = _proc(tmp_path, "decode-0", "import sys; sys.exit(3)")
    sup = Supervisor([p], lambda *e: events.append(e), CrashBackoff(first_s=1.0, cap_s=4.0, stable_s=100.0))
    p.start()
    p.popen.wait(10)
    t0 = p.started_at + 0.5  # it "ran" half a second: a crash loop
    assert sup.tick(t0)  # noticed and, the first time, started again at once
    assert [e[0] for e in events] == ["Crashed", "Started"] and p.restarts == 1 and p.last_exit == 3
    p.popen.wait(10)
    p.started_at = t0
    sup.tick(t0 + 0.1)  # second crash in a row: waits 1 s
    assert p.restart_at == pytest.approx(t0 + 1.1) and p.restarts == 1
    assert not sup.tick(t0 + 0.5)
    assert sup.tick(t0 + 1.2) and p.restarts == 2
    p.popen.wait(10)


def test_supervisor_leaves_a_process_stopped_on_purpose_alone(tmp_path) -> None:
    events: list = []
    p = _proc(tmp_path, "prefill-0", "import time; time.sleep(60)")
    sup = Supervisor([p], lambda *e: events.append(e))
    p.start()
    p.stop()
    assert not sup.tick(p.started_at + 1) and events == [] and not p.running


def test_secrets_reach_the_process_through_its_environment_not_argv(tmp_path) -> None:
    out = tmp_path / "env.txt"
    p = EngineProc(
        "router",
        "router",
        0,
        [
            sys.executable,
            "-c",
            f"import os, sys; open({str(out)!r}, 'w').write(os.environ['DSV4_ADMIN_TOKEN'] + ' ' + ' '.join(sys.argv))",
        ],
        tmp_path / "router.log",
        env={"DSV4_ADMIN_TOKEN": "s3cret"},
    )
    p.start()
    p.popen.wait(10)
    assert out.read_text().startswith("s3cret ") and "s3cret" not in " ".join(p.cmd)


# ---- the detection window ----------------------------------------------------------------------


def test_the_window_defaults_past_the_longest_engine_deadline() -> None:
    deadlines = engine_deadlines([])
    assert deadlines == {F.BOOTSTRAP_TIMEOUT: 30.0, F.TRANSFER_TIMEOUT: 30.0, F.WAITING_TIMEOUT: 60.0}
    assert detection_window(None, deadlines, 2.0) == 60.0 + WINDOW_MARGIN_S
    assert detection_window(None, None, 2.0) == NO_DEADLINES_WINDOW_S


def test_a_window_shorter_than_the_deadlines_is_refused_unless_they_are_off() -> None:
    deadlines = engine_deadlines([])
    with pytest.raises(WindowTooShort, match="--waiting-timeout is 60 s.*at least 64 s"):
        detection_window(20.0, deadlines, 2.0)
    assert detection_window(64.0, deadlines, 2.0) == 64.0
    assert detection_window(4.0, None, 0.5) == 4.0  # --no-deadlines: the window is the user's


def test_engine_args_move_the_deadlines_and_the_window_with_them() -> None:
    args = ["--transfer-timeout=1.5", "--waiting-timeout", "2.5", f"{F.BOOTSTRAP_TIMEOUT}=2", "--dtype", "float32"]
    deadlines = engine_deadlines(args)
    assert deadlines == {F.BOOTSTRAP_TIMEOUT: 2.0, F.TRANSFER_TIMEOUT: 1.5, F.WAITING_TIMEOUT: 2.5}
    assert detection_window(4.0, deadlines, 0.5) == 4.0
    with pytest.raises(WindowTooShort):
        detection_window(3.0, deadlines, 0.5)
    assert engine_deadlines(["--no-deadlines"]) is None
    with pytest.raises(ValueError, match="seconds"):
        engine_deadlines(["--transfer-timeout=soon"])


def test_the_deadlines_up_assumes_are_the_serve_commands_defaults() -> None:
    from dsv4_cli.main import app

    serve = typer.main.get_command(app).commands["serve"]
    defaults = {opt: p.default for p in serve.params for opt in p.opts}
    assert {flag: defaults[flag] for flag in ENGINE_DEADLINES} == dict(ENGINE_DEADLINES)


def test_the_cli_refuses_a_short_window_before_starting_anything(tmp_path) -> None:
    env = {**os.environ, "DSV4_CACHE": str(tmp_path)}
    r = subprocess.run(
        [sys.executable, "-m", "dsv4_cli", "up", "--detection-window", "10"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "too short" in r.stderr, r.stderr
    assert not (tmp_path / "models").exists()  # refused before the tiny model was built


# ---- secrets -----------------------------------------------------------------------------------


def test_a_secret_is_made_once_with_mode_0600_and_kept(tmp_path) -> None:
    folder = local.private_dir(tmp_path / "up" / "8000")
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    path = folder / "admin-token"
    first = stored_secret(path)
    assert len(first) >= 40 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stored_secret(path) == first  # a restarted `dsv4 up` keeps its clients' token


def test_a_secret_others_could_read_is_replaced(tmp_path) -> None:
    path = tmp_path / "admin-token"
    path.write_text("leaked\n")
    os.chmod(path, 0o644)
    fresh = stored_secret(path)
    assert fresh != "leaked" and stat.S_IMODE(path.stat().st_mode) == 0o600


# ---- startup lines -----------------------------------------------------------------------------


def test_startup_lines_never_break_a_path_at_80_columns(tmp_path, monkeypatch) -> None:
    deep = tmp_path / ("a-rather-long-folder-name-" * 3) / "cache"
    monkeypatch.setenv("DSV4_CACHE", str(deep))
    monkeypatch.setenv("COLUMNS", "80")
    model = tmp_path / ("models-with-a-long-name-" * 3) / "tiny-0"
    up = LocalDeployment(UpArgs(model=model, port=18000, engine_args=["--transfer-timeout=5"]))
    buf = io.StringIO()
    monkeypatch.setattr(local.console, "file", buf)  # the console `dsv4 up` prints with, as it is
    assert local.console.width == 80
    up.announce()
    text = buf.getvalue()
    for path in (model, up.state_dir, up.evidence_dir, up.token_path, up.secret_path):
        assert str(path) in text, f"{path} broken in:\n{text}"
    assert up.admin_token not in text and up.pd_secret not in text  # where, never what
    assert "detection window 75 s" in text


def test_a_process_that_cannot_be_spawned_backs_off_instead_of_stopping_the_supervisor(tmp_path) -> None:
    events: list = []
    p = _proc(tmp_path, "router", "pass")
    sup = Supervisor([p], lambda *e: events.append(e), CrashBackoff(first_s=1.0, cap_s=30.0, stable_s=100.0))
    p.start()
    p.popen.wait(10)
    p.cmd = [str(tmp_path / "no-such-program")]
    t0 = p.started_at + 0.1
    sup.tick(t0)
    assert [e[0] for e in events] == ["Crashed", "StartFailed"]
    assert p.crashes == 2 and p.restart_at == pytest.approx(t0 + 1.0)
