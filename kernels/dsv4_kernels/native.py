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

from dsv4_wire import switches

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
_why: dict[str, str] = {}  # library name -> why it did not load (see why_not)
_warned: list[str] = []  # the first library whose build failed: logged at WARNING, the rest at DEBUG
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


def unsafe_chain(entries: Sequence[tuple[str, int, int]], uid: int) -> Optional[str]:
    """Pure: why a library (entries[0]) in its folders up to a root (entries[-1]), each given
    as (path, st_uid, st_mode), must not be loaded, or None: a symbolic link, an owner other
    than this user or root, or write access for others anywhere on the way. A prebuilt folder an
    image ships (root's, mode 0755, libraries 0644) passes; one anyone could write does not."""
    for what, st_uid, st_mode in entries:
        why = unsafe(st_uid, st_mode, uid, what)
        if why is not None:
            return why
    return None


def _untrusted(path: Path, root: Optional[Path] = None) -> Optional[str]:
    """Why `path` (a library, or the cache folder) or a folder above it up to `root` (default:
    the cache root, .../dsv4, the folders this module made) is not safe to load from, or None."""
    root = root or cache_dir().parent
    entries = []
    for p in (path, *path.parents):
        try:
            st = os.lstat(p)
        except OSError as e:
            return f"{p}: {e.strerror}"
        entries.append((str(p), st.st_uid, st.st_mode))
        if p == root:
            break
    return unsafe_chain(entries, os.geteuid())


def _private_dir(path: Path) -> None:
    """Make the cache folders (mode 0700), each one this module creates."""
    for p in reversed([path, *path.parents]):
        if not p.exists():
            p.mkdir(mode=0o700, exist_ok=True)


def disabled() -> bool:
    return switches.on("DSV4_NO_NATIVE")


def _cpu_flags() -> set[str]:
    try:
        line = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags"))
    except (OSError, StopIteration):
        return set()
    return set(line.split(":", 1)[-1].split())


# x86-64 microarchitecture levels (the psABI's): what each adds that the kernels may use
_X86_V2 = {"sse4_2", "ssse3", "popcnt", "cx16"}
_X86_V3 = _X86_V2 | {"avx", "avx2", "fma", "bmi1", "bmi2", "f16c", "movbe", "abm"}
_X86_V4 = _X86_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
ISA_LEVELS = ("x86-64-v4", "x86-64-v3", "x86-64-v2", "x86-64", "armv8-a", "native")


def default_isa(machine: str, cpu_flags: set[str]) -> str:
    """Pure: the ISA level native kernels are built for when DSV4_NATIVE_ISA is unset: the
    highest x86-64 level the CPU has, x86-64-v4 (AVX-512: the kernels' 16-float vectors are one
    register; at v3 they spill, MLA decode ~7x slower), else x86-64-v3 (AVX2 + FMA), else
    x86-64-v2; armv8-a (the baseline) on aarch64. Named levels, not -march=native: a prebuilt
    library runs on any CPU of its level, not only on the one that built it."""
    if machine in ("x86_64", "AMD64"):
        if not cpu_flags or _X86_V4 <= cpu_flags:
            return "x86-64-v4"
        return "x86-64-v3" if _X86_V3 <= cpu_flags else "x86-64-v2"
    if machine in ("aarch64", "arm64"):
        return "armv8-a"
    return "native"


def isa() -> str:
    chosen = switches.read("DSV4_NATIVE_ISA") or default_isa(platform.machine(), _cpu_flags())
    if chosen not in ISA_LEVELS:
        raise ValueError(f"DSV4_NATIVE_ISA={chosen!r}: expected one of {', '.join(ISA_LEVELS)}")
    return chosen


def isa_flags(level: str) -> list[str]:
    return [f"-march={level}"] if level != "native" else ["-march=native"]


def prebuilt_dir() -> Optional[Path]:
    """The folder of libraries built ahead of time (`python -m dsv4_kernels.build_native`),
    searched before the per-user cache: DSV4_NATIVE_DIR."""
    d = switches.read("DSV4_NATIVE_DIR")
    return Path(d) if d else None


def _cpu_key() -> str:
    """What a -march=native build depends on: a cache shared by two kinds of CPU keeps one each."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return platform.machine() + flags


def why_not(name: str) -> str:
    """Why library `name` did not load, in one line ("not built" before `load` tried it)."""
    return _why.get(name, "not built")


def prebuilt_name(src: Path, flags: Sequence[str]) -> str:
    """A prebuilt library's file name: its source and flags (the ISA level among them), not the
    compiler's path (a runtime image may have none)."""
    key = hashlib.sha256(b"\0".join([src.read_bytes(), " ".join(flags).encode()])).hexdigest()[:16]
    return f"{src.stem}-{key}.so"


def _prebuilt(src: Path, flags: Sequence[str]) -> Optional[Path]:
    d = prebuilt_dir()
    if d is None or any(f in ("-march=native", "-mcpu=native") for f in flags):
        return None
    so = d / prebuilt_name(src, flags)
    if not (so.exists() or os.path.islink(so)):
        return None
    why = _untrusted(so, d)
    if why is not None:
        log.warning("not loading the prebuilt native kernel %s: %s", so, why)
        return None
    return so


def machine_levels(machine: str) -> list[str]:
    """Pure: the ISA levels an image for this architecture ships prebuilt (an engine picks its
    CPU's with `default_isa`)."""
    if machine in ("x86_64", "AMD64"):
        return ["x86-64-v4", "x86-64-v3", "x86-64-v2"]
    return ["armv8-a"] if machine in ("aarch64", "arm64") else []


def build_prebuilt(out_dir: Path, level: str, names: Optional[Sequence[str]] = None) -> list[Path]:
    """Build every csrc library (or `names`) for ISA `level` into out_dir, named as `_prebuilt`
    looks them up (an image runs this once a level; its engines then need no compiler)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (set CC or install cc)")
    out_dir.mkdir(parents=True, exist_ok=True)
    built = []
    for name in names or sorted(OWN_FLAGS):
        src = CSRC / f"{name}.c"
        flags = [*BASE_FLAGS, *OWN_FLAGS[name], *isa_flags(level)]
        out = out_dir / prebuilt_name(src, flags)
        subprocess.run([cc, *flags, "-o", str(out), str(src), "-lm"], check=True, capture_output=True, timeout=300)
        os.chmod(out, 0o644)
        built.append(out)
    return built


# Each library's own flags besides BASE_FLAGS and the ISA level, as its module passes them to
# `load` (-ffp-contract=off: products round before their sums, as torch's do); tests check them.
OWN_FLAGS: dict[str, tuple[str, ...]] = {
    "cpu_moe": (),
    "grouped_moe_cpu": ("-ffp-contract=off",),
    "mla_absorb_cpu": (),
    "mla_decode_cpu": (),
    "moe_route_cpu": ("-ffp-contract=off",),
    "rmsnorm_cpu": (),
    "rope_cpu": ("-ffp-contract=off",),
    "v4_attn_cpu": (),
    "v4_compress_cpu": ("-ffp-contract=off",),
    "v4_mhc_cpu": ("-ffp-contract=off",),
}
_FLAGS: dict[str, tuple[str, ...]] = {}  # what each loaded library was given (see OWN_FLAGS)


def _build(src: Path, flags: Sequence[str]) -> Optional[Path]:
    pre = _prebuilt(src, flags)
    if pre is not None:
        return pre
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        _why[src.stem] = "no C compiler (set CC or install cc)"
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
        _why[src.stem] = f"untrusted build: {why}"
        return None
    _private_dir(out.parent)
    why = _untrusted(out.parent)
    if why is not None:  # a library built here could be swapped before it is loaded
        log.warning("not building native kernels in %s: %s (the torch form runs instead)", out.parent, why)
        _why[src.stem] = f"untrusted cache: {why}"
        return None
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *flags, "-o", tmp, str(src), "-lm"], check=True, capture_output=True, timeout=120)
        os.replace(tmp, out)  # atomic: another process building the same key reads a whole file
    except (OSError, subprocess.SubprocessError) as e:
        Path(tmp).unlink(missing_ok=True)
        _why[src.stem] = "native build failed: " + _first_line(e)
        if not _warned:  # once a process: every kernel shares the compiler and the cause
            _warned.append(src.stem)
            log.warning(
                "native kernel %s did not build (%s); its ops, and those of any other kernel that fails "
                "the same way, run the torch reference (dsv4:native_build_failures_total counts them)",
                src.stem,
                _why[src.stem],
            )
        else:
            log.debug("native kernel %s did not build: %s", src.stem, _why[src.stem])
        return None
    return out


def _first_line(e: BaseException) -> str:
    """The compiler's first error line (or the exception's), for the log and /v1/loads."""
    err = getattr(e, "stderr", None)
    text = err.decode(errors="replace") if isinstance(err, bytes) else str(err or "")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return next((ln for ln in lines if "error" in ln), lines[0] if lines else str(e))


def load(
    name: str, extra_flags: Sequence[str] = (), *, off_env: str = "", signatures: Optional[Signatures] = None
) -> Optional[ctypes.CDLL]:
    """csrc/<name>.c as a loaded library, or None (see the module's docstring). Built once per
    process; `off_env` names a kernel's own switch besides DSV4_NO_NATIVE; `signatures` gives
    each C function's (argument types, return type), set once when the library loads."""
    if name in _loaded:
        return _loaded[name]
    lib = None
    if disabled():
        _why[name] = "off: DSV4_NO_NATIVE=1"
    elif off_env and switches.on(off_env):
        _why[name] = f"off: {off_env}=1"
    else:
        # the ISA level replaces a module's -march=native (see default_isa)
        own = tuple(f for f in extra_flags if f not in ("-march=native", "-mcpu=native"))
        _FLAGS[name] = own
        so = _build(CSRC / f"{name}.c", [*BASE_FLAGS, *own, *isa_flags(isa())])
        if so is not None:
            try:
                lib = ctypes.CDLL(str(so))
                for fn, (args, res) in (signatures or {}).items():
                    getattr(lib, fn).argtypes, getattr(lib, fn).restype = list(args), res
            except (OSError, AttributeError) as e:  # AttributeError: a stale build without a function
                _why[name] = f"native library did not load: {e}"
                lib = None
    _loaded[name] = lib
    return lib
