"""Pure parts of the KV transfer layer: descriptors (paged and slot regions), page tables,
page- and slot-mapping checks, region checksums."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch

from dsv4_engine.pd.checksum import checksum_mismatch, region_checksums, tensor_checksum
from dsv4_engine.pd.nixl.agent import PeerDescriptor, check_page_mapping, page_table, transfer_rows
from dsv4_engine.pd.transport import Layout, PoolStates, Region, check_slot_mapping, regions_of, transfer_bytes

KV = Region("kv", "float32", (2, 16, 64), 8192)


def descriptor(regions=(KV,), **over) -> PeerDescriptor:
    fields = dict(
        agent="decode-0",
        nixl_metadata=b"\x00md\xff",
        num_pages=16,
        mem_type="DRAM",
        device_id=0,
        regions=tuple(regions),
        base_addrs=tuple(0x7F00_0000_0000 + i * (1 << 30) for i in range(len(regions))),
        num_slots=8 if any(r.kind == "slot" for r in regions) else 0,
        page_size=16,
    )
    fields.update(over)
    return PeerDescriptor(**fields)


def test_descriptor_round_trips_through_json():
    d = descriptor()
    wire = json.loads(json.dumps(d.to_dict()))
    assert wire["nixl_metadata"] == base64.b64encode(b"\x00md\xff").decode()
    assert PeerDescriptor.from_dict(wire) == d


@pytest.mark.parametrize(
    "change",
    [
        {"version": 2},
        {"agent": ""},
        {"nixl_metadata": "not base64!"},
        {"nixl_metadata": ""},
        {"mem_type": "cuda"},
        {"regions": []},
        {"regions": [{"name": "kv", "dtype": "float32", "shape": [2, 0, 64], "nbytes": 8192, "base_addr": 1}]},
        {"regions": [{"name": "kv", "dtype": "float32", "shape": [2, 16, 64], "nbytes": "8192", "base_addr": 1}]},
        {"regions": [{"name": "kv", "dtype": "float32", "shape": [2, 16, 64], "nbytes": 8192, "base_addr": True}]},
        {"regions": [{"name": "", "dtype": "float32", "shape": [2, 16, 64], "nbytes": 8192, "base_addr": 1}]},
        {"regions": [{"name": "kv", "dtype": "float32", "shape": [2, 16, 64], "nbytes": 8192, "base_addr": 1}] * 2},
        {"regions": [{"name": "kv", "kind": "ring", "dtype": "float32", "shape": [2], "nbytes": 8, "base_addr": 1}]},
        {
            "regions": [
                {"name": "kv", "dtype": "float32", "shape": [2], "nbytes": 8, "tokens_per_entry": 0, "base_addr": 1}
            ]
        },
        # a slot region needs num_slots > 0, and paged regions come first
        {
            "regions": [
                {"name": "kv", "dtype": "float32", "shape": [2], "nbytes": 8, "base_addr": 1},
                {"name": "ring", "kind": "slot", "dtype": "float32", "shape": [2], "nbytes": 8, "base_addr": 2},
            ]
        },
        {
            "regions": [
                {"name": "ring", "kind": "slot", "dtype": "float32", "shape": [2], "nbytes": 8, "base_addr": 2},
                {"name": "kv", "dtype": "float32", "shape": [2], "nbytes": 8, "base_addr": 1},
            ],
            "num_slots": 4,
        },
        {"num_slots": 3},  # slots without slot regions
        {"num_pages": 0},
        {"page_size": -1},
        {"device_id": -1},
    ],
)
def test_malformed_descriptor_is_refused(change):
    wire = descriptor().to_dict()
    wire.update(change)
    with pytest.raises(ValueError):
        PeerDescriptor.from_dict(wire)


def test_descriptor_missing_field_is_refused():
    wire = descriptor().to_dict()
    del wire["num_pages"]
    with pytest.raises(ValueError, match="num_pages"):
        PeerDescriptor.from_dict(wire)
    with pytest.raises(ValueError):
        PeerDescriptor.from_dict(["not", "a", "dict"])


RING = Region("ring", "bfloat16", (3, 8, 32), 1536, "slot")
CSA = Region("csa_kv", "float32", (2, 4, 64), 2048, "page", 4)


def test_layout_mismatch_names_the_difference():
    d = descriptor()
    assert d.layout_mismatch(descriptor(agent="x", base_addrs=(1,), num_pages=99, mem_type="VRAM")) is None
    assert "page size 8192 B != 4096 B" in d.layout_mismatch(descriptor([Region("kv", "float32", (2, 16, 64), 4096)]))
    assert "dtype" in d.layout_mismatch(descriptor([Region("kv", "bfloat16", (2, 16, 64), 8192)]))
    assert "page shape" in d.layout_mismatch(descriptor([Region("kv", "float32", (4, 8, 64), 8192)]))
    assert "page size 16 != 32 tokens" in d.layout_mismatch(descriptor(page_size=32))
    assert "state regions" in d.layout_mismatch(descriptor([Region("latent", "float32", (2, 16, 64), 8192)]))
    # slot regions: their names, row shapes and dtypes are part of the layout
    assert "slot state regions [] != ['ring']" in d.layout_mismatch(descriptor([KV, RING]))
    assert descriptor([KV, RING]).layout_mismatch(descriptor([KV, RING], agent="y", num_slots=3)) is None
    wider = Region("ring", "bfloat16", (3, 16, 32), 3072, "slot")
    assert "slot region ring: slot shape [3, 8, 32] != [3, 16, 32]" in descriptor([KV, RING]).layout_mismatch(
        descriptor([KV, wider])
    )
    assert "slot region ring: dtype" in descriptor([KV, RING]).layout_mismatch(
        descriptor([KV, Region("ring", "float32", (3, 8, 32), 3072, "slot")])
    )
    # a compressed state whose rate differs, even where the page shape happens to agree
    other_rate = Region("csa_kv", "float32", (2, 4, 64), 2048, "page", 8)
    assert "compress rate 4 != 8" in descriptor([KV, CSA]).layout_mismatch(descriptor([KV, other_rate]))


def test_descriptor_with_slot_regions_round_trips_and_lays_out_rows_region_by_region():
    d = descriptor([KV, CSA, RING], num_pages=4, num_slots=3)
    assert PeerDescriptor.from_dict(json.loads(json.dumps(d.to_dict()))) == d
    table = d.page_table()
    assert table.shape == (4 + 4 + 3, 3)  # pages of each paged region, then the slot rows
    assert table[4:8, 0].tolist() == [d.base_addrs[1] + i * 2048 for i in range(4)]
    assert table[8:, 0].tolist() == [d.base_addrs[2] + i * 1536 for i in range(3)] and set(table[8:, 1]) == {1536}
    regions = [KV, CSA, RING]
    assert transfer_rows(np.array([3, 1]), 2, regions, 4, 3).tolist() == [3, 1, 7, 5, 10]
    assert transfer_rows(np.array([3, 1]), None, [KV, CSA], 4, 0).tolist() == [3, 1, 7, 5]
    assert transfer_bytes(regions, 2, True) == {"kv": 16384, "csa_kv": 4096, "ring": 1536}


def test_regions_of_a_pool_follow_its_states():
    states = {"kv": torch.zeros(5, 2, 16, 8), "idx": torch.zeros(5, 3, 4, dtype=torch.bfloat16)}
    assert regions_of(states) == [Region("kv", "float32", (2, 16, 8), 1024), Region("idx", "bfloat16", (3, 4), 24)]
    with pytest.raises(ValueError, match="share page ids"):
        regions_of({"kv": torch.zeros(5, 2), "ring": torch.zeros(4, 2)})
    pool = PoolStates(
        {"kv": torch.zeros(5, 2, 16, 8)},
        {"ring": torch.zeros(3, 2, 8), "st": torch.zeros(3, 4)},
        page_size=16,
        tokens_per_entry={"kv": 1},
    )
    assert [(r.name, r.kind, r.nbytes) for r in pool.regions()] == [
        ("kv", "page", 1024),
        ("ring", "slot", 64),
        ("st", "slot", 16),
    ]
    assert pool.layout() == Layout(tuple(pool.regions()), 16) and pool.num_slots == 3
    with pytest.raises(ValueError, match="share slot row ids"):
        regions_of({"kv": torch.zeros(5, 2)}, {"ring": torch.zeros(3, 2), "st": torch.zeros(2, 2)})


@pytest.mark.parametrize(
    "src,dst,slots,why",
    [
        (None, 1, (4, 4), "src_slot must be a slot row"),
        (0, None, (4, 4), "dst_slot must be a slot row"),
        (4, 0, (4, 4), "src_slot 4 is outside"),
        (0, -1, (4, 4), "dst_slot -1 is outside"),
        (True, 0, (4, 4), "src_slot must be"),
        (0, 0, (0, 0), "no slot state regions"),
    ],
)
def test_bad_slot_mapping_is_refused(src, dst, slots, why):
    with pytest.raises(ValueError, match=why):
        check_slot_mapping(src, dst, *slots)
    check_slot_mapping(None, None, 0, 0)
    check_slot_mapping(3, 0, 4, 1)


def test_region_checksums_see_a_flipped_or_moved_byte_and_agree_across_layouts():
    g = torch.Generator().manual_seed(0)
    pool = PoolStates(
        {"kv": torch.randn(6, 2, 4, 8, generator=g), "idx": torch.randn(6, 3, generator=g).bfloat16()},
        {"ring": torch.randn(4, 5, 3, generator=g)},
    )
    sent = region_checksums(pool, [4, 1, 2], 3)
    assert set(sent) == {"kv", "idx", "ring"} and all(len(v) == 32 for v in sent.values())
    # the same bytes in other pages and rows of another pool check out
    other = PoolStates({k: torch.zeros_like(v) for k, v in pool.pages.items()}, {"ring": torch.zeros(2, 5, 3)})
    for k in pool.pages:
        other.pages[k][[0, 5, 3]] = pool.pages[k][[4, 1, 2]]
    other.slots["ring"][1] = pool.slots["ring"][3]
    assert checksum_mismatch(sent, region_checksums(other, [0, 5, 3], 1)) is None
    # page order matters, a flipped byte matters, in a paged and in a slot region
    assert "region(s) kv, idx" in checksum_mismatch(sent, region_checksums(other, [5, 0, 3], 1))
    other.slots["ring"][1].view(-1).view(torch.uint8)[7] ^= 1
    assert "region(s) ring" in checksum_mismatch(sent, region_checksums(other, [0, 5, 3], 1))
    assert "regions differ" in checksum_mismatch(sent, region_checksums(other, [0, 5, 3], None))
    # swapping two words keeps the plain sum but not the weighted one
    t = torch.arange(8, dtype=torch.int32)
    swapped = t[[1, 0, 2, 3, 4, 5, 6, 7]]
    assert tensor_checksum(t)[:16] == tensor_checksum(swapped)[:16] and tensor_checksum(t) != tensor_checksum(swapped)
    assert tensor_checksum(torch.ones(3, dtype=torch.uint8)) != tensor_checksum(torch.zeros(3, dtype=torch.uint8))


def test_page_table_has_one_row_per_page():
    t = page_table(base_addr=1 << 40, page_nbytes=4096, num_pages=4, device_id=3)
    assert t.dtype == np.uint64 and t.shape == (4, 3)
    assert t[:, 0].tolist() == [(1 << 40) + i * 4096 for i in range(4)]
    assert set(t[:, 1].tolist()) == {4096} and set(t[:, 2].tolist()) == {3}


def test_page_mapping_accepts_lists_arrays_and_tensors():
    src, dst = check_page_mapping([3, 3, 0], np.array([1, 2, 7]), 4, 8)
    assert src.dtype == np.int32 and src.tolist() == [3, 3, 0]
    assert dst.tolist() == [1, 2, 7]
    src, _ = check_page_mapping(torch.tensor([1]), [0], 2, 1)
    assert src.tolist() == [1]


@pytest.mark.parametrize(
    "src, dst, why",
    [
        ([0, 1], [2], "source pages but"),
        ([], [], "no pages"),
        ([4], [0], "src_pages has page 4"),
        ([-1], [0], "src_pages has page -1"),
        ([0], [8], "dst_pages has page 8"),
        ([0, 1], [5, 5], "same page twice"),
        ([0.0], [1], "integers"),
        ([True], [1], "integers"),
        ([[0]], [[1]], "flat"),
        (["a"], [1], "integers"),
    ],
)
def test_bad_page_mapping_is_refused(src, dst, why):
    with pytest.raises(ValueError, match=why):
        check_page_mapping(src, dst, 4, 8)
