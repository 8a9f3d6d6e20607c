"""The disk tier below the host tier (`--disk-cache-dir`, `--disk-cache-gb`): a host tier too
small for the working set spills what it drops to files, a later round reads them back instead of
recomputing (outputs equal an engine without any tier, token for token); a corrupted or torn file
is a miss, never KV; the tier is bounded, emptied at start, and refuses unsafe directories."""

from __future__ import annotations

import os

import pytest
import torch

from dsv4_engine.disk_tier import DiskTier, disk_dir_refusal, disk_tier_refusal
from dsv4_engine.engine import Engine
from dsv4_engine.engine_args import EngineArgs
from test_host_tier import PAGE, prompts, rounds


FIRSTS = prompts()[:4]  # 4 conversations of 5 pages each (prompt + answer)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


def _args(tiny_model, device: str = "cpu", **kw) -> dict:
    backend = {"kernel_backend": "torch"} if device == "cpu" else {}
    return dict(model=str(tiny_model), device=device, kv_pages=10, page_size=PAGE, max_num_seqs=2, **backend, **kw)


_PLAIN: dict = {}


def plain_rounds(tiny_model, device: str = "cpu"):
    """Round 2's outputs and cached tokens of an engine without any tier (once per device)."""
    if device not in _PLAIN:
        eng = Engine(EngineArgs(**_args(tiny_model, device)))
        _PLAIN[device] = (rounds(eng, FIRSTS), eng.pool.page_nbytes)
    return _PLAIN[device][0]


def _tiered(tiny_model, tmp_path, device: str = "cpu", host_pages: int = 3, disk_gb: float = 0.05) -> Engine:
    plain_rounds(tiny_model, device)
    gb = host_pages * _PLAIN[device][1] / (1 << 30)
    disk = dict(host_cache_gb=gb, disk_cache_dir=str(tmp_path / "kv"), disk_cache_gb=disk_gb)
    return Engine(EngineArgs(**_args(tiny_model, device, **disk)))


@pytest.mark.parametrize("device", DEVICES)
def test_pages_the_host_tier_drops_come_back_from_disk_with_equal_outputs(tiny_model, tmp_path, device):
    # on CUDA: the host pages are pinned and copied non_blocking; a dropped one is synced, then written
    want, plain_hits = plain_rounds(tiny_model, device)
    eng = _tiered(tiny_model, tmp_path, device)
    got, hits = rounds(eng, FIRSTS)
    assert got == want
    tiers = eng._tiers()
    # 10 device pages + 3 host pages hold 2 of the 4 conversations' 5 pages: the rest came from disk
    assert tiers["disk"]["stored"] > 0 and tiers["host"]["restored_from_disk"] > 0, tiers
    assert sum(hits) > sum(plain_hits) and min(hits) >= 4 * PAGE, (hits, plain_hits)
    assert tiers["disk"]["corrupt"] == 0 and tiers["disk"]["bytes"] <= tiers["disk"]["bytes_total"]
    eng.prefix_cache.check()


@pytest.mark.slow
def test_a_corrupted_or_torn_file_is_a_miss_never_kv(tiny_model, tmp_path):
    want, _ = plain_rounds(tiny_model)
    eng = _tiered(tiny_model, tmp_path)
    firsts = [p + list(eng_run(eng, f"a{k}", p)) for k, p in enumerate(FIRSTS)]
    files = sorted((tmp_path / "kv").glob("*.page"))
    assert files
    for i, f in enumerate(files):  # every other file corrupted in its payload, the rest torn
        data = bytearray(f.read_bytes())
        if i % 2:
            data[len(data) // 2] ^= 0xFF
            f.write_bytes(bytes(data))
        else:
            f.write_bytes(bytes(data[: len(data) // 3]))
    got = [list(eng_run(eng, f"b{k}", p + [7, 8, 9])) for k, p in enumerate(firsts)]
    assert got == want
    disk = eng._tiers()["disk"]
    assert disk["corrupt"] > 0  # read, refused, deleted: those pages were recomputed
    eng.prefix_cache.check()


def eng_run(eng: Engine, rid: str, prompt: list[int]) -> list[int]:
    from test_host_tier import run

    return run(eng, rid, prompt).output_ids


def test_the_tier_is_bounded_and_drops_its_oldest_files(tmp_path):
    page = {"kv": torch.randn(16, 8), "k": torch.randn(16, 2).to(torch.bfloat16)}
    one = DiskTier(str(tmp_path / "probe"), 1 << 20)
    one.put(b"\x00" * 16, (0, "salt"), page)
    size = one.bytes
    tier = DiskTier(str(tmp_path / "d"), 3 * size)
    evicted = []
    tier.on_evict = evicted.append
    hs = [bytes([i]) * 16 for i in range(5)]
    for i, h in enumerate(hs):
        assert tier.put(h, (i, "salt"), page)
    assert tier.bytes <= 3 * size and len(os.listdir(tmp_path / "d")) == 3
    assert evicted == hs[:2] and not tier.holds(hs[0]) and tier.holds(hs[4])
    got = tier.read(hs[4], (4, "salt"), page)
    assert all(torch.equal(got[n], page[n]) for n in page)
    assert tier.read(hs[4], (5, "salt"), page) is None  # another page's key: a miss, and the file goes
    assert not tier.holds(hs[4]) and tier.corrupt == 1 and evicted[-1] == hs[4]


def test_a_flipped_byte_or_a_cut_file_reads_as_a_miss_and_goes(tmp_path):
    page = {"kv": torch.randn(16, 8)}
    tier = DiskTier(str(tmp_path), 1 << 20)
    for i, damage in enumerate(("flip", "cut", "empty")):
        h = bytes([i]) * 16
        tier.put(h, (i,), page)
        f = tmp_path / (h.hex() + ".page")
        data = bytearray(f.read_bytes())
        if damage == "flip":
            data[-40] ^= 1  # in the payload
        f.write_bytes(bytes(data[: len(data) // 2]) if damage == "cut" else b"" if damage == "empty" else bytes(data))
        assert tier.read(h, (i,), page) is None and not f.exists() and not tier.holds(h)
    assert tier.corrupt == 3 and tier.bytes == 0


def test_the_directory_is_emptied_of_tier_files_at_start(tmp_path):
    d = tmp_path / "kv"
    d.mkdir(mode=0o700)
    (d / ("ab" * 16 + ".page")).write_bytes(b"old")
    (d / ("cd" * 16 + ".page.tmp-99")).write_bytes(b"half")
    (d / "notes.txt").write_text("not ours")
    tier = DiskTier(str(d), 1 << 20)
    assert sorted(os.listdir(d)) == ["notes.txt"] and tier.cleared == 2 and tier.stats()["files"] == 0


def test_unsafe_directories_and_flags_are_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    assert "symlink" in disk_dir_refusal(str(link))
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    assert "world-writable" in disk_dir_refusal(str(open_dir))
    f = tmp_path / "file"
    f.write_text("")
    assert "not a directory" in disk_dir_refusal(str(f))
    assert disk_dir_refusal(str(real)) is None and disk_dir_refusal(str(tmp_path / "new")) is None
    assert "--disk-cache-gb" in disk_tier_refusal(str(real), 0, 1)
    assert "--host-cache-gb" in disk_tier_refusal(str(real), 1, 0)
    assert "--disk-cache-dir" in disk_tier_refusal(None, 1, 1)
    assert disk_tier_refusal(None, 0, 0) is None
    with pytest.raises(ValueError, match="world-writable"):
        DiskTier(str(open_dir), 1 << 20)
