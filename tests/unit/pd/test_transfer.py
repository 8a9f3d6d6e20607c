"""Pure parts of the KV transfer layer: descriptors, page tables, page-mapping checks."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch

from dsv4_engine.pd.nixl.agent import PeerDescriptor, check_page_mapping, page_table, region_rows
from dsv4_engine.pd.transport import Region, regions_of

KV = Region("kv", "float32", (2, 16, 64), 8192)


def descriptor(regions=(KV,), **over) -> PeerDescriptor:
    fields = dict(
        agent="decode-0", nixl_metadata=b"\x00md\xff", num_pages=16, mem_type="DRAM", device_id=0,
        regions=tuple(regions), base_addrs=tuple(0x7F00_0000_0000 + i * (1 << 30) for i in range(len(regions))),
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
        {"version": 1},
        {"agent": ""},
        {"nixl_metadata": "not base64!"},
        {"nixl_metadata": ""},
        {"mem_type": "cuda"},
        {"regions": []},
        {"regions": [{"name": "kv", "dtype": "float32", "page_shape": [2, 0, 64], "page_nbytes": 8192, "base_addr": 1}]},
        {"regions": [{"name": "kv", "dtype": "float32", "page_shape": [2, 16, 64], "page_nbytes": "8192", "base_addr": 1}]},
        {"regions": [{"name": "kv", "dtype": "float32", "page_shape": [2, 16, 64], "page_nbytes": 8192, "base_addr": True}]},
        {"regions": [{"name": "", "dtype": "float32", "page_shape": [2, 16, 64], "page_nbytes": 8192, "base_addr": 1}]},
        {"regions": [{"name": "kv", "dtype": "float32", "page_shape": [2, 16, 64], "page_nbytes": 8192, "base_addr": 1}] * 2},
        {"num_pages": 0},
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


def test_layout_mismatch_names_the_difference():
    d = descriptor()
    assert d.layout_mismatch(descriptor(agent="x", base_addrs=(1,), num_pages=99, mem_type="VRAM")) is None
    assert "page size" in d.layout_mismatch(descriptor([Region("kv", "float32", (2, 16, 64), 4096)]))
    assert "dtype" in d.layout_mismatch(descriptor([Region("kv", "bfloat16", (2, 16, 64), 8192)]))
    assert "page shape" in d.layout_mismatch(descriptor([Region("kv", "float32", (4, 8, 64), 8192)]))
    ring = Region("ring", "bfloat16", (3, 8, 32), 1536)
    assert "state regions ['kv'] != ['kv', 'ring']" in d.layout_mismatch(descriptor([KV, ring]))
    assert "state regions" in d.layout_mismatch(descriptor([Region("latent", "float32", (2, 16, 64), 8192)]))
    assert descriptor([KV, ring]).layout_mismatch(descriptor([KV, ring], agent="y")) is None


def test_multi_region_descriptor_round_trips_and_lays_out_rows_region_by_region():
    ring = Region("ring", "bfloat16", (3, 8, 32), 1536)
    d = descriptor([KV, ring], num_pages=4)
    assert PeerDescriptor.from_dict(json.loads(json.dumps(d.to_dict()))) == d
    table = d.page_table()
    assert table.shape == (8, 3)
    assert table[4:, 0].tolist() == [d.base_addrs[1] + i * 1536 for i in range(4)]
    assert region_rows(np.array([3, 1]), 2, 4).tolist() == [3, 1, 7, 5]


def test_regions_of_a_pool_follow_its_states():
    states = {"kv": torch.zeros(5, 2, 16, 8), "ring": torch.zeros(5, 3, 4, dtype=torch.bfloat16)}
    assert regions_of(states) == [Region("kv", "float32", (2, 16, 8), 1024), Region("ring", "bfloat16", (3, 4), 24)]
    with pytest.raises(ValueError, match="share page ids"):
        regions_of({"kv": torch.zeros(5, 2), "ring": torch.zeros(4, 2)})


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
