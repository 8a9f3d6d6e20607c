"""What runs is said: a native build that fails leaves its ops on the torch reference, says so
per op (with the compiler's first error line), warns once and counts the failures."""

from __future__ import annotations

import logging

from dsv4_kernels import native, ops_cpu
from dsv4_kernels.api import get_ops


def test_a_failed_native_build_is_reported_per_op_warned_once_and_counted(tmp_path, monkeypatch, caplog):
    cc = tmp_path / "cc"
    cc.write_text("#!/bin/sh\necho 'cc1: error: this compiler is broken on purpose' >&2\nexit 1\n")
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    # a fresh process's state: nothing loaded yet (restored after the test)
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "_why", {})
    monkeypatch.setattr(native, "_warned", [])
    for lib in ops_cpu._LIBRARIES.values():
        if lib is not None:
            monkeypatch.setattr(lib[0], "_lib", None)
    with caplog.at_level(logging.DEBUG, logger="dsv4.kernels"):
        ops = get_ops("cpu")
    why = "cpu: reference (native build failed: cc1: error: this compiler is broken on purpose)"
    impl = ops.implementations()
    assert impl["rmsnorm"] == why and impl["v4_mhc"] == why
    assert impl["mla_extend"] == "cpu: reference (no native kernel)"
    assert ops.build_failures() == 10  # every csrc library of the CPU backend
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "did not build" in warnings[0].getMessage()


def test_the_torch_backend_runs_the_reference_for_every_op():
    ops = get_ops("torch")
    assert set(ops.implementations().values()) == {"torch: reference"}
    assert ops.build_failures() == 0
