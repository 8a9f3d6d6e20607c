"""Secrets on the command line (issue 27, item 4): from files (flag or *_FILE variable), never
both ways at once; a prefill/decode engine on a non-loopback address refuses to start without a
PD secret, in one line, before anything is loaded."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def dsv4(*args, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dsv4_cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_pd_engine_on_a_public_address_needs_a_pd_secret(tiny_model, role):
    env = {"DSV4_PD_SECRET": "", "DSV4_PD_SECRET_FILE": ""}
    r = dsv4("serve", "--model", tiny_model, "--role", role, "--host", "0.0.0.0", env=env)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"error: --role {role} on 0.0.0.0 needs a PD secret (--pd-secret-file or DSV4_PD_SECRET): without one "
        "anyone who reaches the port can register as a peer and choose bootstrap targets"
    ], r.stderr


def test_secret_files_and_their_refusals(tiny_model, tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("\n")
    r = dsv4("serve", "--model", tiny_model, "--role", "prefill", "--host", "0.0.0.0", "--pd-secret-file", empty)
    assert r.returncode == 2 and "is empty" in r.stderr, r.stderr
    r = dsv4("serve", "--model", tiny_model, "--admin-token", "x", env={"DSV4_ADMIN_TOKEN_FILE": str(empty)})
    assert r.returncode == 2 and "not both" in r.stderr, r.stderr
    r = dsv4("router", "--mono", "http://127.0.0.1:1", "--pd-secret-file", tmp_path / "missing")
    assert r.returncode == 2 and "--pd-secret-file" in r.stderr and "No such file" in r.stderr, r.stderr
    r = dsv4("router", "--mono", "http://127.0.0.1:1", "--cache-salt-from-api-key")
    assert r.returncode == 2 and "needs --api-key" in r.stderr, r.stderr
    r = dsv4(
        "router", "--mono", "http://127.0.0.1:1", "--api-key", "k", "--cache-salt-from-api-key", "--shared-prefix-cache"
    )
    assert r.returncode == 2 and "contradict" in r.stderr, r.stderr


def test_a_secret_is_read_whole_from_its_file(tmp_path):
    from dsv4_cli.main import _secret

    f = tmp_path / "token"
    f.write_text("s3cret\n")
    assert _secret(None, str(f), "--admin-token") == "s3cret"
    assert _secret("given", None, "--admin-token") == "given"
