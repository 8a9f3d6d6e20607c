"""Native kernels are built for a named ISA level, not for whichever CPU built them, and may be
built ahead of time into a folder an image ships (root's, read-only to the engine)."""

from __future__ import annotations

import shutil
import stat

import pytest

from dsv4_kernels import native

V3 = {"sse4_2", "ssse3", "popcnt", "cx16", "avx", "avx2", "fma", "bmi1", "bmi2", "f16c", "movbe", "abm"}


def test_the_default_level_is_named_and_falls_back():
    v4 = V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
    assert native.default_isa("x86_64", v4) == "x86-64-v4"
    assert native.default_isa("x86_64", V3 | {"avx512f"}) == "x86-64-v3"
    assert native.default_isa("x86_64", {"sse4_2", "ssse3", "popcnt", "cx16"}) == "x86-64-v2"
    assert native.default_isa("aarch64", {"fp", "asimd"}) == "armv8-a"
    assert native.isa_flags("x86-64-v3") == ["-march=x86-64-v3"]
    assert native.machine_levels("x86_64") == ["x86-64-v4", "x86-64-v3", "x86-64-v2"]


def test_the_ownership_rule_accepts_a_root_owned_read_only_prebuilt_folder():
    d, f = stat.S_IFDIR, stat.S_IFREG
    user = 10001  # the engine's user in the image
    shipped = [("/opt/dsv4/native/x.so", 0, f | 0o644), ("/opt/dsv4/native", 0, d | 0o755)]
    assert native.unsafe_chain(shipped, user) is None
    mine = [("/c/x.so", user, f | 0o600), ("/c", user, d | 0o700)]
    assert native.unsafe_chain(mine, user) is None
    world = [("/opt/n/x.so", 0, f | 0o644), ("/opt/n", 0, d | 0o777)]
    assert "writable by others" in native.unsafe_chain(world, user)
    foreign = [("/opt/n/x.so", 4242, f | 0o644), ("/opt/n", 0, d | 0o755)]
    assert "owned by uid 4242" in native.unsafe_chain(foreign, user)
    link = [("/opt/n/x.so", 0, stat.S_IFLNK | 0o777), ("/opt/n", 0, d | 0o755)]
    assert "symbolic link" in native.unsafe_chain(link, user)


def test_the_modules_pass_the_declared_flags():
    from dsv4_kernels.api import get_ops

    get_ops("cpu")  # loads every library of the CPU backend
    assert {n: f for n, f in native._FLAGS.items()} == {n: native.OWN_FLAGS[n] for n in native._FLAGS}


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
def test_a_prebuilt_library_loads_without_a_compiler(tmp_path, monkeypatch):
    pre = tmp_path / "native"
    native.build_prebuilt(pre, native.isa(), ["rope_cpu"])
    pre.chmod(0o755)
    monkeypatch.setenv("DSV4_NATIVE_DIR", str(pre))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "_why", {})
    assert native.load("rope_cpu", ["-march=native", "-ffp-contract=off"]) is not None
    assert not (tmp_path / "cache").exists()  # nothing was built
    pre.chmod(0o777)  # a folder anyone could write: refused
    monkeypatch.setattr(native, "_loaded", {})
    assert native.load("rope_cpu", ["-march=native", "-ffp-contract=off"]) is None
