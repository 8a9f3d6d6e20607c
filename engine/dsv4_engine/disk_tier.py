"""The disk tier: KV pages (and DeepSeek-V4 slot-row snapshots) the host tier drops for room are
written to files under `--disk-cache-dir`, bounded by `--disk-cache-gb`, and read back on a hit
instead of being recomputed.

One file per page, `<chain hash>.page` (snapshots: `.snap`), raw: a header (magic, version, the
page's key tokens, each state's name, dtype, shape), the states' bytes, and a BLAKE2b-128 of all
of it at the end. Written to a temporary name and renamed (a reader never sees a half-written
file under its final name); read back only when the checksum, the key tokens and every state's
name, dtype and shape match what the engine asks for, else the file is deleted and the read is a
miss (a torn or corrupted file never becomes KV). The tier's own LRU deletes its least recently
used file when the next one would pass the bound.

The index lives in the process: a restarted engine cannot trust what it finds (another model,
another build, a half-written rename), so the directory is emptied of this tier's files at start
(`cleared` in the KV events) and `kill -9` loses only cache. The directory is refused when it is
a symlink, not a directory, not ours, or writable by others: KV read from it is trusted as the
model's own state, so nobody else may be able to write there.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
import time
from collections import OrderedDict
from pathlib import Path
from typing import Optional

import torch

MAGIC = b"DSV4KV1\n"
SUFFIXES = (".page", ".snap")
_DIGEST = 16


def disk_dir_refusal(path: str) -> Optional[str]:
    """Why `path` cannot hold the disk tier, in one line, or None (it exists, or can be made, as a
    directory of ours that nobody else can write into)."""
    p = Path(path)
    if p.is_symlink():
        return f"--disk-cache-dir {path} is a symlink: give the real directory"
    if not p.exists():
        return None
    st = p.stat()
    if not stat.S_ISDIR(st.st_mode):
        return f"--disk-cache-dir {path} is not a directory"
    if st.st_mode & stat.S_IWOTH:
        return f"--disk-cache-dir {path} is world-writable: another user could plant KV there (chmod o-w)"
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        return f"--disk-cache-dir {path} belongs to uid {st.st_uid}, not this process's {os.getuid()}"
    return None


def disk_tier_refusal(path: Optional[str], gb: float, host_gb: float) -> Optional[str]:
    """Why the disk tier cannot be used with these flags, or None."""
    if path is None:
        return "--disk-cache-gb needs --disk-cache-dir" if gb else None
    if gb <= 0:
        return "--disk-cache-dir needs --disk-cache-gb > 0 (the tier's bound)"
    if host_gb <= 0:
        return "--disk-cache-dir needs --host-cache-gb > 0: the disk tier holds what the host tier drops"
    return disk_dir_refusal(path)


def _raw(t: torch.Tensor) -> bytes:
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


class DiskTier:
    def __init__(self, path: str, max_bytes: int):
        refusal = disk_dir_refusal(path)
        if refusal:
            raise ValueError(refusal)
        self.dir = Path(path)
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.cleared = self._clear()
        self.max_bytes = int(max_bytes)
        self._lru: "OrderedDict[str, int]" = OrderedDict()  # file name -> bytes
        self.bytes = 0
        self.stored = self.restored = self.evicted = self.corrupt = 0
        self.io_s = 0.0  # engine-thread seconds spent writing and reading files
        self.on_evict = lambda h: None  # told when a page's file is deleted for room (kv events)

    def _clear(self) -> int:
        n = 0
        for f in self.dir.iterdir():
            if f.is_file() and (f.suffix in SUFFIXES or ".tmp-" in f.name):
                f.unlink(missing_ok=True)
                n += 1
        return n

    @staticmethod
    def _name(h: bytes, suffix: str) -> str:
        return h.hex() + suffix

    @property
    def num_pages(self) -> int:
        return sum(1 for n in self._lru if n.endswith(".page"))

    def holds(self, h: bytes, suffix: str = ".page") -> bool:
        return self._name(h, suffix) in self._lru

    def put(self, h: bytes, key: tuple, states: dict[str, torch.Tensor], suffix: str = ".page") -> bool:
        """Write one page (or snapshot) of `states` (name -> that page's tensor); False when it
        does not fit the bound at all or is held already."""
        name = self._name(h, suffix)
        if name in self._lru:
            self._lru.move_to_end(name)
            return False
        t0 = time.perf_counter()
        meta = {"key": [k for k in key], "states": [[n, str(t.dtype), list(t.shape)] for n, t in states.items()]}
        head = json.dumps(meta).encode()
        body = [MAGIC, struct.pack("<I", len(head)), head, *(_raw(t) for t in states.values())]
        digest = hashlib.blake2b(digest_size=_DIGEST)
        for part in body:
            digest.update(part)
        size = sum(len(b) for b in body) + _DIGEST
        if size > self.max_bytes:
            return False
        while self.bytes + size > self.max_bytes and self._lru:
            old, n = self._lru.popitem(last=False)
            (self.dir / old).unlink(missing_ok=True)
            self.bytes -= n
            self.evicted += 1
            if old.endswith(".page"):
                self.on_evict(bytes.fromhex(old[: -len(".page")]))
        tmp = self.dir / f"{name}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            for part in body:
                f.write(part)
            f.write(digest.digest())
        os.replace(tmp, self.dir / name)
        self._lru[name] = size
        self.bytes += size
        self.stored += 1
        self.io_s += time.perf_counter() - t0
        return True

    def read(self, h: bytes, key: tuple, like: dict[str, torch.Tensor], suffix: str = ".page"):
        """The page held under (h, key) as {name: tensor} shaped like `like` (name -> one page's
        tensor), or None: not held, or its file torn, corrupted or of another shape (then deleted)."""
        name = self._name(h, suffix)
        if name not in self._lru:
            return None
        t0 = time.perf_counter()
        try:
            got = self._parse((self.dir / name).read_bytes(), key, like)
        except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError, struct.error):
            got = None
        self.io_s += time.perf_counter() - t0
        if got is None:
            self.corrupt += 1
            self._drop(name)
            if suffix == ".page":
                self.on_evict(h)  # gone from this tier (kv events)
            return None
        self._lru.move_to_end(name)
        self.restored += 1
        return got

    def _drop(self, name: str) -> None:
        self.bytes -= self._lru.pop(name, 0)
        (self.dir / name).unlink(missing_ok=True)

    @staticmethod
    def _parse(data: bytes, key: tuple, like: dict[str, torch.Tensor]) -> Optional[dict[str, torch.Tensor]]:
        if len(data) < len(MAGIC) + 4 + _DIGEST or not data.startswith(MAGIC):
            return None
        if hashlib.blake2b(data[:-_DIGEST], digest_size=_DIGEST).digest() != data[-_DIGEST:]:
            return None
        (n,) = struct.unpack_from("<I", data, len(MAGIC))
        at = len(MAGIC) + 4
        meta = json.loads(data[at : at + n])
        at += n
        if tuple(meta["key"]) != tuple(key):
            return None
        want = [[name, str(t.dtype), list(t.shape)] for name, t in like.items()]
        if meta["states"] != want:
            return None
        out = {}
        for name, t in like.items():
            nbytes = t.numel() * t.element_size()
            buf = bytearray(data[at : at + nbytes])
            at += nbytes
            out[name] = torch.frombuffer(buf, dtype=torch.uint8).view(t.dtype).reshape(t.shape)
        return out if at == len(data) - _DIGEST else None

    def stats(self) -> dict:
        return {
            "pages": self.num_pages,
            "files": len(self._lru),
            "bytes": self.bytes,
            "bytes_total": self.max_bytes,
            "stored": self.stored,
            "restored": self.restored,
            "evicted": self.evicted,
            "corrupt": self.corrupt,
            "cleared_at_start": self.cleared,
            "io_seconds": round(self.io_s, 4),
        }
