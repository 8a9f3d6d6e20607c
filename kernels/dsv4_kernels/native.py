"""Small C kernels for the CPU path, built with the system C compiler at first use and loaded
with ctypes (no torch headers, no build step at install: each file builds in about a second).

`load()` returns None wherever native code cannot run here: no compiler, a failed build, a cache
that will not load (noexec mount, foreign architecture) or DSV4_NO_NATIVE=1. Every caller keeps
its torch form for that case, so a machine without a compiler is slower, never broken."""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Mapping, Optional, Sequence

CSRC = Path(__file__).parent / "csrc"
BASE_FLAGS = ("-O3", "-shared", "-fPIC", "-fno-math-errno")
_loaded: dict[str, Optional[ctypes.CDLL]] = {}

# argument types for `signatures`: pointers (a tensor's data_ptr()), integers, floats
P, I64, I32, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
Signatures = Mapping[str, tuple[Sequence[type], Optional[type]]]


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "dsv4" / "native"


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
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
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
