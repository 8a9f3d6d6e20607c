"""Small C kernels for the CPU path, built with the system C compiler at first use and loaded
with ctypes (no torch headers, no build step at install: each file builds in about a second).

`load()` returns None wherever native code cannot run here: no compiler, a failed build, a cache
that will not load (noexec mount, foreign architecture), a cache someone else could have written
(see `unsafe`) or DSV4_NO_NATIVE=1. Every caller keeps its torch form for that case, so a machine
without a compiler is slower, never broken.

Whoever can write a library into the cache runs code in the engine (issue 39): the cache folders
are made mode 0700, and a library is loaded only when it and its folders are owned by this user
or root (an image's prebuilt libraries are root's) and writable by no one else."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path
from typing import Mapping, Optional, Sequence

CSRC = Path(__file__).parent / "csrc"
BASE_FLAGS = ("-O3", "-shared", "-fPIC", "-fno-math-errno")
_loaded: dict[str, Optional[ctypes.CDLL]] = {}
log = logging.getLogger("dsv4.kernels")

# argument types for `signatures`: pointers (a tensor's data_ptr()), integers, floats
P, I64, I32, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
Signatures = Mapping[str, tuple[Sequence[type], Optional[type]]]


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "dsv4" / "native"


def unsafe(st_uid: int, st_mode: int, uid: int, what: str) -> Optional[str]:
    """Pure: why a cached library or folder with this owner and mode must not be trusted, or None."""
    if stat.S_ISLNK(st_mode):
        return f"{what} is a symbolic link"
    if st_uid not in (uid, 0):
        return f"{what} is owned by uid {st_uid}, not by this user ({uid}) or root"
    if st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{what} is writable by others (mode {stat.S_IMODE(st_mode):o})"
    return None


def _untrusted(path: Path) -> Optional[str]:
    """Why `path` (a library, or the cache folder) or a folder above it up to the cache root is
    not safe to load from, or None."""
    uid = os.geteuid()
    root = cache_dir().parent  # .../dsv4: the folders this module made
    for p in (path, *path.parents):
        try:
            st = os.lstat(p)
        except OSError as e:
            return f"{p}: {e.strerror}"
        why = unsafe(st.st_uid, st.st_mode, uid, str(p))
        if why is not None:
            return why
        if p == root:
            return None
    return None


def _private_dir(path: Path) -> None:
    """Make the cache folders (mode 0700), each one this module creates."""
    for p in reversed([path, *path.parents]):
        if not p.exists():
            p.mkdir(mode=0o700, exist_ok=True)


def disabled() -> bool:
    return os.environ.get("DSV4_NO_NATIVE", "") not in ("", "0")


def _cpu_key() -> str:
    """What a -march=native build depends on: a cache shared by two kinds of CPU keeps one each."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return platform.machine() + flags


def _build(src: Path, flags: Sequence[str]) -> Optional[Path]:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    key_parts = [src.read_bytes(), " ".join([cc, *flags]).encode()]
    if any(f.startswith("-march=native") or f.startswith("-mcpu=native") for f in flags):
        key_parts.append(_cpu_key().encode())
    key = hashlib.sha256(b"\0".join(key_parts)).hexdigest()[:16]
    out = cache_dir() / f"{src.stem}-{key}.so"
    if out.exists() or os.path.islink(out):
        why = _untrusted(out)
        if why is None:
            return out
        log.warning("not loading the native kernel %s: %s (the torch form runs instead)", out.name, why)
        return None
    _private_dir(out.parent)
    why = _untrusted(out.parent)
    if why is not None:  # a library built here could be swapped before it is loaded
        log.warning("not building native kernels in %s: %s (the torch form runs instead)", out.parent, why)
        return None
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *flags, "-o", tmp, str(src), "-lm"], check=True, capture_output=True, timeout=120)
        os.replace(tmp, out)  # atomic: another process building the same key reads a whole file
    except (OSError, subprocess.SubprocessError):
        Path(tmp).unlink(missing_ok=True)
        return None
    return out


def load(
    name: str, extra_flags: Sequence[str] = (), *, off_env: str = "", signatures: Optional[Signatures] = None
) -> Optional[ctypes.CDLL]:
    """csrc/<name>.c as a loaded library, or None (see the module's docstring). Built once per
    process; `off_env` names a kernel's own switch besides DSV4_NO_NATIVE; `signatures` gives
    each C function's (argument types, return type), set once when the library loads."""
    if name in _loaded:
        return _loaded[name]
    lib = None
    if not disabled() and not (off_env and os.environ.get(off_env, "") not in ("", "0")):
        so = _build(CSRC / f"{name}.c", [*BASE_FLAGS, *extra_flags])
        if so is not None:
            try:
                lib = ctypes.CDLL(str(so))
                for fn, (args, res) in (signatures or {}).items():
                    getattr(lib, fn).argtypes, getattr(lib, fn).restype = list(args), res
            except (OSError, AttributeError):  # AttributeError: a stale build without a function
                lib = None
    _loaded[name] = lib
    return lib
