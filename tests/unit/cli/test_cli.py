"""The CLI contract: every command has --help; a bad flag or a missing model exits non-zero
with a clear error line."""

from __future__ import annotations

import subprocess
import sys

import pytest

COMMANDS = [
    ["model", "init"],
    ["serve"],
    ["router"],
    ["up"],
    ["operator"],
]
# `dsv4 bench NAME` hands every argument to its suite (an argparse parser): help and errors are the
# suite's own.
BENCH_COMMANDS = [["bench", name] for name in ("serve", "pd", "nixl", "grammar", "agents", "prefix", "spec")]


def dsv4(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dsv4_cli", *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("cmd", COMMANDS, ids=" ".join)
def test_help(cmd):
    r = dsv4(*cmd, "--help")
    assert r.returncode == 0 and "Usage:" in r.stdout


@pytest.mark.parametrize("cmd", COMMANDS, ids=" ".join)
def test_bad_flag_is_one_clear_error(cmd):
    r = dsv4(*cmd, "--no-such-flag")
    assert r.returncode == 2
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("Error:")]
    assert errors == ["Error: No such option: --no-such-flag"] or (
        len(errors) == 1 and "--no-such-flag" in errors[0]
    ), r.stderr


@pytest.mark.parametrize("cmd", BENCH_COMMANDS, ids=" ".join)
def test_bench_help_and_bad_flag_are_the_suites(cmd):
    r = dsv4(*cmd, "--help")
    assert r.returncode == 0 and r.stdout.startswith("usage:"), r.stdout + r.stderr
    r = dsv4(*cmd, "--no-such-flag")
    errors = [ln for ln in r.stderr.splitlines() if "error:" in ln]
    assert r.returncode == 2 and len(errors) == 1 and "--no-such-flag" in errors[0], r.stderr


@pytest.mark.parametrize("args", [["serve", "--model", "/nonexistent"], ["up", "--model", "/nonexistent"]])
def test_missing_model_is_one_line(args):
    r = dsv4(*args)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "error: no model at /nonexistent (expected /nonexistent/config.json); make one with `dsv4 model init DIR`"
    ]


def test_bad_values():
    assert "--role must be" in dsv4("serve", "--model", "/x", "--role", "chef").stderr
    assert "unknown preset" in dsv4("model", "init", "/tmp/never", "--preset", "huge").stderr
    r = dsv4("router", "--prefill", "http://127.0.0.1:1")
    assert r.returncode == 2 and "needs at least one --prefill and one --decode" in r.stderr


def test_bad_chat_flags_are_one_line(tiny_model):
    for flags, words in (
        (["--tool-call-parser", "hermes"], "unknown tool-call parser 'hermes'"),
        (["--reasoning-parser", "qwen3"], "unknown reasoning parser 'qwen3'"),
        (["--chat-template", "/nonexistent.jinja"], "--chat-template: no file"),
    ):
        r = dsv4("serve", "--model", str(tiny_model), *flags)
        assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1 and words in r.stderr, r.stderr


def test_training_a_v4_preset_with_quantized_weights_is_refused_before_writing(tmp_path):
    r = dsv4("model", "init", str(tmp_path / "q"), "--preset", "v4-tiny", "--train-mtp", "--quant", "fp8")
    assert r.returncode == 2 and "--train-mtp trains float weights" in r.stderr, r.stderr
    assert not (tmp_path / "q" / "config.json").exists()


@pytest.mark.slow
def test_training_a_v4_preset_is_not_refused(tmp_path):
    # `--train` and `--train-mtp` on v4-tiny, tiny budgets (the V4 trainer's own tests:
    # tests/unit/engine/test_mtp_train_v4.py)
    r = subprocess.run(
        [sys.executable, "-m", "dsv4_cli", "model", "init", str(tmp_path / "m"), "--preset", "v4-tiny", "--train"]
        + ["--train-base-steps", "12", "--train-mtp", "--train-steps", "5"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    assert "trained the main model" in r.stdout and "trained the MTP layer" in r.stdout, r.stdout
