"""2 MB pages under long-lived CPU tensors (dsv4_kernels.huge_pages): the values stay, only
whole 2 MB pages inside a storage are marked, each storage once in a list, and the switch turns
it off."""

import pytest
import torch

from dsv4_kernels import huge_pages

pytestmark = pytest.mark.skipif(not huge_pages.enabled(), reason="Linux only, and DSV4_NO_HUGE_PAGES is set")

MB2 = 2 << 20


def test_advise_keeps_the_values_and_marks_whole_pages_inside():
    w = torch.randn(3 << 19)  # 6 MB: whole 2 MB pages inside, and parts at both ends
    before = w.clone()
    marked = huge_pages.advise(w)
    assert marked % MB2 == 0 and MB2 <= marked <= w.numel() * 4
    assert huge_pages.advise(w[10:]) == marked  # a view: its storage's pages, again (no harm)
    assert huge_pages.advise_all([w, w[5:], w.view(2, -1)]) == marked  # one storage, once
    assert huge_pages.advise(torch.randn(100)) == 0  # no whole 2 MB page inside
    assert torch.equal(w, before)


def test_the_switch_turns_it_off(monkeypatch):
    monkeypatch.setenv("DSV4_NO_HUGE_PAGES", "1")
    assert not huge_pages.enabled()
    assert huge_pages.advise(torch.randn(3 << 19)) == 0
