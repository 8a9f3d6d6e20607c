"""The V3 per-head (expanded) attention of a step's prompts at once (EXPANDED_BATCHED: one lift
for all of them, causal row blocks) gives what the per-request form (SDPA) gives: fresh prompts,
prompts over a cached prefix, lengths off the page grid, a decode next to them, fp32 and bf16."""

import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model(mla512_model):
    from dsv4_engine.engine import Engine
    from dsv4_engine.engine_args import EngineArgs

    engine = Engine(
        EngineArgs(model=str(mla512_model), device="cpu", kernel_backend="cpu", dtype="float32", kv_pages=64)
    )
    return engine.runner.local_model


def _batch(seq_lens: list[int], ext_lens: list[int], page_size: int, n_pages: int, g: torch.Generator):
    from dsv4_engine.models.forward_batch import ForwardBatch

    B, T = len(seq_lens), sum(ext_lens)
    width = max(-(-s // page_size) for s in seq_lens)
    # each request's pages scattered over the pool, none shared
    table = torch.randperm(n_pages, generator=g)[: B * width].view(B, width).to(torch.int32)
    positions = torch.cat([torch.arange(s - e, s) for s, e in zip(seq_lens, ext_lens)])
    rows = torch.repeat_interleave(torch.arange(B), torch.tensor(ext_lens))
    slots = table[rows, positions // page_size].long() * page_size + positions % page_size
    return ForwardBatch(
        input_ids=torch.zeros(T, dtype=torch.long),
        positions=positions,
        slot_mapping=slots,
        block_table=table,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        extend_lens=torch.tensor(ext_lens, dtype=torch.int32),
        logits_indices=torch.tensor(ext_lens).cumsum(0) - 1,
        all_decode=False,
        page_size=page_size,
        seq_lens_host=seq_lens,
        extend_lens_host=ext_lens,
    )


@pytest.mark.parametrize(
    "seq_lens, ext_lens, q_dtype, pool_dtype",
    [
        ([128, 128, 40], [128, 128, 1], torch.float32, torch.float32),  # two prompts and a decode
        ([37, 200, 90], [37, 70, 90], torch.float32, torch.float32),  # off the page grid, a prefix
        ([300, 17], [131, 17], torch.float32, torch.bfloat16),  # a bf16 pool
        ([150, 64], [150, 30], torch.bfloat16, torch.bfloat16),  # a bf16 model
    ],
)
def test_batched_expanded_form_matches_the_per_request_form(
    model, monkeypatch, seq_lens, ext_lens, q_dtype, pool_dtype
):
    import dataclasses

    from dsv4_engine.layers import mla as V3

    cfg = model.cfg
    g = torch.Generator().manual_seed(sum(seq_lens))
    page_size, n_pages = 16, 64
    fb = _batch(seq_lens, ext_lens, page_size, n_pages, g)
    kv_layer = torch.randn(n_pages, page_size, cfg.kv_cache_dim, generator=g).to(pool_dtype)
    q = torch.randn(sum(ext_lens), cfg.num_attention_heads, cfg.qk_head_dim, generator=g).to(q_dtype)
    attn = model.layers[1].attn
    attn = dataclasses.replace(attn, w_uk=attn.w_uk.to(q_dtype), w_uv=attn.w_uv.to(q_dtype))
    expand = [V3.expanded_is_cheaper(e, s, cfg) for s, e in zip(seq_lens, ext_lens)]
    assert any(expand)
    monkeypatch.setattr(V3, "EXPANDED_BLOCK", 48)  # several blocks a prompt, a partial last one
    outs = {}
    for batched in (False, True):
        monkeypatch.setattr(V3, "EXPANDED_BATCHED", batched)
        outs[batched] = attn.attend_mixed_forms(q, fb, kv_layer, expand)
    tol = 1e-5 if q_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[True], outs[False], rtol=tol, atol=tol)
