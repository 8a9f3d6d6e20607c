"""The engine against Hugging Face transformers running the same checkpoint (fp32).

Per-step logits of prefill and decode must match, and greedy tokens must be identical for a
batch whose requests arrive at different steps, with chunked prefill, and with preemption
forced by a tiny page pool. Both presets.
"""

from __future__ import annotations

import pytest
import torch

from dsv4_engine.engine import Engine
from dsv4_engine.engine_args import EngineArgs
from dsv4_engine.kv_cache import KVPool
from dsv4_engine.model_runner import ModelRunner
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.scheduler import Scheduler
from dsv4_engine.sequence import Sequence

NEW_TOKENS = 32


@pytest.fixture(scope="module", params=["tiny", "mla512"])
def model_dir(request, make_model):
    return make_model(request.param)


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import DeepseekV3ForCausalLM

    m = DeepseekV3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return m


def hf_generate(hf, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """HF greedy tokens and the raw logits of every step (prefill's last position first)."""
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[0, len(prompt) :].tolist(), [lg[0].float() for lg in out.logits]


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    return hf_generate(hf, prompt, n)[0]


def prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


def test_logits_match_every_step(model_dir, hf):
    runner = ModelRunner(model_dir, "float32", "cpu", "torch")
    pool = KVPool(runner.state_specs, 64, 16, torch.float32, torch.device("cpu"))
    sched = Scheduler(pool.allocator, 16, 4, 1024)
    prompt = prompts(runner.cfg.vocab_size, [37])[0]
    seq = Sequence("a", prompt, SamplingParams(max_tokens=NEW_TOKENS, temperature=0))
    sched.add(seq)
    ref_tokens, ref_logits = hf_generate(hf, prompt, NEW_TOKENS)
    worst = 0.0
    for step in range(NEW_TOKENS):
        batch = sched.schedule()
        assert batch[0].num_new == (len(prompt) if step == 0 else 1)
        ours = runner.forward(batch, pool)[0]
        seq.num_computed += batch[0].num_new
        ref = ref_logits[step]
        worst = max(worst, (ours - ref).abs().max().item())
        assert torch.allclose(ours, ref, atol=1e-4, rtol=1e-4), f"step {step}: max diff {(ours - ref).abs().max()}"
        tok = int(ours.argmax())
        assert tok == ref_tokens[step]
        seq.output_ids.append(tok)
    assert worst < 1e-4


def run_engine(
    model_dir, arrivals: dict[int, list[tuple[str, list[int]]]], **kw
) -> tuple[dict[str, list[int]], Engine, list]:
    """Drive an engine step by step (no thread); requests join at the steps given."""
    engine = Engine(EngineArgs(model=str(model_dir), device="cpu", kernel_backend="cpu", **kw))
    outs: dict[str, list[int]] = {}
    done: set[str] = set()

    def sink_for(rid):
        def sink(out):
            outs.setdefault(rid, []).extend(out.token_ids)
            if out.finished:
                assert out.finish_reason == "length", (rid, out)
                done.add(rid)

        return sink

    total = sum(len(v) for v in arrivals.values())
    seqs = []
    step = 0
    while len(done) < total:
        for rid, prompt in arrivals.get(step, []):
            seqs.append(
                Sequence(
                    rid,
                    prompt,
                    SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True),
                    sink=sink_for(rid),
                )
            )
            engine.submit(seqs[-1])
        engine.step()
        step += 1
        assert step < 2000, "engine made no progress"
    return outs, engine, seqs


def test_staggered_batch_greedy_matches_hf(model_dir, hf):
    cfg_vocab = hf.config.vocab_size
    ps = prompts(cfg_vocab, [5, 40, 17, 64], seed=1)
    arrivals = {0: [("r0", ps[0])], 3: [("r1", ps[1]), ("r2", ps[2])], 7: [("r3", ps[3])]}
    outs, engine, _ = run_engine(model_dir, arrivals, kv_pages=256, page_size=16)
    for rid, prompt in zip(["r0", "r1", "r2", "r3"], ps):
        assert outs[rid] == hf_greedy(hf, prompt, NEW_TOKENS), rid
    assert engine.pool.allocator.num_free == engine.pool.num_pages


def test_chunked_prefill_and_preemption_match_hf(model_dir, hf):
    ps = prompts(hf.config.vocab_size, [50, 45, 30], seed=2)
    arrivals = {0: [("a", ps[0]), ("b", ps[1])], 2: [("c", ps[2])]}
    # A 12-token step budget forces chunked prefill; 12 pages of 8 tokens cannot hold all three
    # requests' 80+ tokens each at once, so the scheduler must preempt and recompute.
    outs, engine, seqs = run_engine(model_dir, arrivals, kv_pages=12, page_size=8, max_num_batched_tokens=12)
    assert sum(s.num_preemptions for s in seqs) > 0, "the tiny pool should have forced a preemption"
    for rid, prompt in zip("abc", ps):
        assert outs[rid] == hf_greedy(hf, prompt, NEW_TOKENS), rid
    assert engine.pool.allocator.num_free == engine.pool.num_pages


def test_checkpoint_saved_by_transformers_loads_and_matches(tmp_path):
    """A checkpoint written by transformers' own save_pretrained (its names, its config with
    rope_parameters) runs in the engine with the same logits."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    cfg = DeepseekV3Config(
        vocab_size=300,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.0,
        max_position_embeddings=512,
        initializer_range=0.1,
    )
    hf = DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for mod in hf.modules():
            if hasattr(mod, "e_score_correction_bias"):
                mod.e_score_correction_bias.normal_(0, 0.05)
    hf.save_pretrained(tmp_path)
    runner = ModelRunner(tmp_path, "float32", "cpu", "torch")
    pool = KVPool(runner.state_specs, 16, 16, torch.float32, torch.device("cpu"))
    sched = Scheduler(pool.allocator, 16, 4, 1024)
    prompt = prompts(300, [23], seed=4)[0]
    sched.add(Sequence("a", prompt, SamplingParams(max_tokens=4, temperature=0)))
    ours = runner.forward(sched.schedule(), pool)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1].float()
    assert torch.allclose(ours, ref, atol=1e-4, rtol=1e-4)


def test_bfloat16_tracks_float32(tiny_model):
    prompt = prompts(512, [40], seed=6)[0]
    logits = {}
    for dtype in ("float32", "bfloat16"):
        runner = ModelRunner(tiny_model, dtype, "cpu", "torch")
        pool = KVPool(runner.state_specs, 16, 16, runner.dtype, torch.device("cpu"))
        sched = Scheduler(pool.allocator, 16, 4, 1024)
        sched.add(Sequence("a", prompt, SamplingParams(max_tokens=4, temperature=0)))
        logits[dtype] = runner.forward(sched.schedule(), pool)[0]
    f32, bf16 = logits["float32"], logits["bfloat16"]
    assert bf16.dtype == torch.float32 and torch.isfinite(bf16).all()
    assert (bf16 - f32).abs().max() < 0.1 * f32.abs().max()
    assert torch.corrcoef(torch.stack([f32, bf16]))[0, 1] > 0.99
