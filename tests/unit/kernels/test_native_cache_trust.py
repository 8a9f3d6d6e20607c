"""The native kernel build cache (issue 39 item 10): whoever can write a library there runs code
in the engine, so its folders are private and a library is loaded only when it and its folders
are this user's (or root's) and writable by no one else."""

from __future__ import annotations

import os
import shutil
import stat

import pytest

from dsv4_kernels import native

FLAGS = [*native.BASE_FLAGS]


def test_what_is_trusted():
    me = os.geteuid()
    file = stat.S_IFREG
    assert native.unsafe(me, file | 0o600, me, "f") is None
    assert native.unsafe(0, file | 0o755, me, "f") is None  # an image's prebuilt library
    assert "owned by uid" in native.unsafe(me + 1, file | 0o600, me, "f")
    assert "writable by others" in native.unsafe(me, file | 0o666, me, "f")
    assert "writable by others" in native.unsafe(me, stat.S_IFDIR | 0o775, me, "d")
    assert "symbolic link" in native.unsafe(me, stat.S_IFLNK | 0o777, me, "l")


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
def test_a_planted_or_exposed_library_is_not_loaded(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    src = native.CSRC / "rmsnorm_cpu.c"
    built = native._build(src, FLAGS)
    assert built is not None and built.parent == native.cache_dir()
    for d in (native.cache_dir(), native.cache_dir().parent):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700, d
    assert native._build(src, FLAGS) == built  # ours, private: used again
    # Writable by others: anyone could have swapped it.
    os.chmod(built, 0o666)
    assert native._build(src, FLAGS) is None
    os.chmod(built, 0o600)
    os.chmod(native.cache_dir(), 0o777)
    assert native._build(src, FLAGS) is None
    os.chmod(native.cache_dir(), 0o700)
    # A library planted as a link to something else.
    built.unlink()
    planted = tmp_path / "evil.so"
    planted.write_bytes(b"not a library")
    built.symlink_to(planted)
    assert native._build(src, FLAGS) is None
    assert "not loading the native kernel" in caplog.text
