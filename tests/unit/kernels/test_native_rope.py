"""The native CPU rope (dsv4_kernels.cpu_rope) against the torch form (reference.rope_interleaved_):
bit for bit on fp32, in place on strided views."""

import pytest
import torch

from dsv4_kernels import cpu_rope
from dsv4_kernels import reference

pytestmark = pytest.mark.skipif(not cpu_rope.available(), reason="no native build here")


def _tables(max_pos, half, seed=0):
    g = torch.Generator().manual_seed(seed)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), torch.rand(half, generator=g))
    return freqs.cos() * 1.3, freqs.sin() * 1.3


@pytest.mark.parametrize("T,H,nope,R", [(0, 8, 128, 64), (1, 8, 128, 64), (5, 3, 16, 8), (32, 1, 0, 64)])
def test_bit_for_bit_the_torch_form_on_a_strided_view(T, H, nope, R):
    cos, sin = _tables(300, R // 2)
    g = torch.Generator().manual_seed(T + H)
    q = torch.randn(T, H, nope + R, generator=g) * 4
    pos = torch.randint(0, 300, (T,), generator=g)
    ref = q.clone()
    reference.rope_interleaved_(ref[:, :, nope:], pos, cos, sin)
    got = q.clone()
    view = got[:, :, nope:]
    assert cpu_rope.supports(view, pos, cos, sin)
    assert cpu_rope.rope_interleaved_(view, pos, cos, sin) is view
    assert torch.equal(got, ref)  # the nope part untouched, the rope part the same bits


def test_a_column_slice_of_a_projection():
    cos, sin = _tables(50, 32)
    ckv = torch.randn(4, 512 + 64)
    pos = torch.tensor([0, 7, 49, 3])
    ref = ckv.clone()
    reference.rope_interleaved_(ref[:, 512:].unsqueeze(1), pos, cos, sin)
    cpu_rope.rope_interleaved_(ckv[:, 512:].unsqueeze(1), pos, cos, sin)
    assert torch.equal(ckv, ref)


def test_position_outside_the_table_raises_and_leaves_x():
    cos, sin = _tables(10, 4)
    x = torch.randn(2, 1, 8)
    before = x.clone()
    with pytest.raises(IndexError):
        cpu_rope.rope_interleaved_(x, torch.tensor([1, 10]), cos, sin)
    assert torch.equal(x, before)


def test_supports_only_what_it_takes():
    cos, sin = _tables(10, 4)
    x, pos = torch.randn(2, 1, 8), torch.tensor([1, 2])
    assert cpu_rope.supports(x, pos, cos, sin)
    assert not cpu_rope.supports(x.double(), pos, cos, sin)
    assert not cpu_rope.supports(x, pos.int(), cos, sin)
    assert not cpu_rope.supports(x.transpose(1, 2), pos, cos, sin)
    assert not cpu_rope.supports(torch.randn(2, 1, 6), pos, cos, sin)


@pytest.mark.usefixtures("one_torch_thread")
def test_engine_greedy_tokens_native_rope_on_and_off(make_model, monkeypatch):
    from dsv4_engine.engine import Engine
    from dsv4_engine.engine_args import EngineArgs
    from dsv4_engine.sampling_params import SamplingParams
    from dsv4_engine.sequence import Sequence

    model_dir = make_model("mla512")
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(2, 200, (n,), generator=g).tolist() for n in (9, 40)]

    def greedy():
        engine = Engine(
            EngineArgs(model=str(model_dir), device="cpu", kernel_backend="cpu", dtype="float32", kv_pages=64)
        )
        seqs = [
            Sequence(f"r{i}", p, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
            for i, p in enumerate(prompts)
        ]
        for s in seqs:
            engine.submit(s)
        while engine.scheduler.has_work() or any(len(s.output_ids) < 10 for s in seqs):
            engine.step()
        return [s.output_ids for s in seqs]

    calls = []
    real = cpu_rope.rope_interleaved_
    monkeypatch.setattr(cpu_rope, "rope_interleaved_", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    on = greedy()
    assert calls
    monkeypatch.setattr(cpu_rope, "supports", lambda *a: False)
    calls.clear()
    assert greedy() == on
    assert not calls
