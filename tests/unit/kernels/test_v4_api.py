"""Both backends expose the V4 kernels under the same names and engine-facing signatures."""

from __future__ import annotations

import inspect

import pytest

from dsv4_kernels import reference_v4
from dsv4_kernels.api import get_ops

V4_API = list(reference_v4.__all__)


def test_v4_api_is_the_whole_reference_module():
    public = {
        n
        for n, f in vars(reference_v4).items()
        if inspect.isfunction(f) and not n.startswith("_") and f.__module__ == reference_v4.__name__
    }
    assert public == set(V4_API)


@pytest.mark.parametrize("name", V4_API)
def test_backends_share_each_v4_signature(name):
    def engine_facing(fn):
        params = inspect.signature(fn).parameters.values()
        return [(p.name, p.kind, p.default) for p in params if p.kind != p.KEYWORD_ONLY]

    torch_ops, triton_ops = get_ops("torch"), get_ops("triton")
    assert getattr(torch_ops, name) is getattr(reference_v4, name)
    assert engine_facing(getattr(triton_ops, name)) == engine_facing(getattr(reference_v4, name))
