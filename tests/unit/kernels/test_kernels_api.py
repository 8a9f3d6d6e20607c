"""The three backends expose one API: same op names, same positional signatures."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

from dsv4_kernels import api, reference

API = ["mla_decode", "mla_extend", "moe_route", "moe_experts", "rmsnorm", "rope_interleaved_"]


def test_get_ops_picks_the_backend():
    from dsv4_kernels import triton_ops

    assert api.get_ops("torch").rmsnorm is reference.rmsnorm
    assert api.get_ops("triton").mla_decode is triton_ops.mla_decode
    assert api.get_ops("cpu").name == "cpu"
    with pytest.raises(ValueError, match="torch"):
        api.get_ops("cuda")


@pytest.mark.parametrize("name", API)
def test_backends_share_each_signature(name):
    from dsv4_kernels import triton_ops

    def engine_facing(fn):
        """Parameters the engine passes; launchers may add keyword-only tuning knobs."""
        return [
            (p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values() if p.kind != p.KEYWORD_ONLY
        ]

    assert engine_facing(getattr(triton_ops, name)) == engine_facing(getattr(reference, name))


def test_torch_backend_does_not_import_triton():
    """A CPU engine on the torch backend never pays for importing triton."""
    code = "import sys; from dsv4_kernels.api import get_ops; get_ops('torch'); get_ops('cpu'); print('triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_compiled_kernels_on_cpu_tensors_fail_with_a_clear_message():
    """Without TRITON_INTERPRET at import time, CPU tensors cannot reach a compiled kernel."""
    code = (
        "import os, torch; os.environ.pop('TRITON_INTERPRET', None)\n"
        "from dsv4_kernels import triton_ops\n"
        "try:\n"
        "    triton_ops.rmsnorm(torch.ones(2, 4), torch.ones(4), 1e-6)\n"
        "except RuntimeError as e:\n"
        "    print(e)\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    assert "TRITON_INTERPRET=1" in out
