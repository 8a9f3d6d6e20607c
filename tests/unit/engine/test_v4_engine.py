"""DeepSeek-V4 through the real engine loop (Engine.step, scheduler, pool, model runner; no HTTP)
against transformers' DeepseekV4ForCausalLM on v4-tiny in fp32: the logits of every sampled
token and the greedy tokens, for staggered arrivals, chunked prefill at awkward split points and
forced preemption; plus the state sizing and refusals of the pool."""

from __future__ import annotations

import pytest
import torch

from dsv4_engine.engine import Engine, state_refusal
from dsv4_engine.engine_args import EngineArgs
from dsv4_engine.kv_cache import pages_for_memory, slot_row_nbytes
from dsv4_engine.models.deepseek_v4 import DeepseekV4
from dsv4_engine.models.deepseek_v4_config import DeepseekV4Config
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.sequence import Sequence

transformers = pytest.importorskip("transformers")

TOL = 1e-4
NEW_TOKENS = 12


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def v4_dir(make_model):
    return make_model("v4-tiny")


@pytest.fixture(scope="module")
def hf(v4_dir):
    return transformers.DeepseekV4ForCausalLM.from_pretrained(str(v4_dir), dtype=torch.float32).eval()


def oracle(hf, prompt: list[int], n: int) -> torch.Tensor:
    """transformers' logits after the prompt and after each greedy token: [n, vocab]."""
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
        cache, logits = out.past_key_values, [out.logits[0, -1]]
        for _ in range(n - 1):
            out = hf(logits[-1].argmax().view(1, 1), cache=cache, use_cache=True)
            cache = out.past_key_values
            logits.append(out.logits[0, -1])
    return torch.stack(logits)


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [0] + torch.randint(2, 500, (n - 1,), generator=g).tolist()


def run_engine(v4_dir, arrivals: dict[int, list[tuple[str, list[int]]]], **kw):
    """Drive an engine step by step; requests join at the steps given. Returns each request's
    tokens and the logits each of them was sampled from, and the engine."""
    engine = Engine(EngineArgs(model=str(v4_dir), device="cpu", kernel_backend="cpu", **kw))
    toks: dict[str, list[int]] = {}
    logits: dict[str, list[torch.Tensor]] = {}
    done: set[str] = set()
    forward = engine.runner.forward

    engine.mixed_steps = 0  # steps with decodes and prefills together (the runner splits them)

    def recording_forward(batch, pool):
        news = {b.num_new == 1 for b in batch}
        engine.mixed_steps += news == {True, False}
        out = forward(batch, pool)
        for b, row in zip(batch, out):
            if b.samples:
                logits.setdefault(b.seq.rid, []).append(row.clone())
        return out

    engine.runner.forward = recording_forward

    def sink(out):
        toks.setdefault(out.rid, []).extend(out.token_ids)
        if out.finished:
            assert out.finish_reason == "length", out
            done.add(out.rid)

    seqs = []
    total = sum(len(v) for v in arrivals.values())
    step = 0
    while len(done) < total:
        for rid, p in arrivals.get(step, []):
            seqs.append(
                Sequence(rid, p, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True), sink=sink)
            )
            engine.submit(seqs[-1])
        engine.step()
        step += 1
        assert step < 3000, "engine made no progress"
    return toks, {rid: torch.stack(v) for rid, v in logits.items()}, engine, seqs


def check(hf, prompts: dict[str, list[int]], toks, logits) -> None:
    for rid, p in prompts.items():
        want = oracle(hf, p, NEW_TOKENS)
        assert logits[rid].shape == want.shape, rid
        err = float((logits[rid] - want).abs().max())
        assert err < TOL, f"{rid}: max |logit diff| {err}"
        assert toks[rid] == want.argmax(-1).tolist(), rid


def all_returned(engine: Engine) -> None:
    assert engine.pool.allocator.num_free == engine.pool.num_pages
    assert engine.pool.slots.num_free == engine.pool.num_slots
    assert not engine.seqs and not engine.scheduler.running and not engine.scheduler.waiting


def test_staggered_arrivals_in_one_batch(v4_dir, hf):
    """Shorter than the window (8), at and one past the window / HCA window, one past a CSA
    window, long enough that top-4 drops CSA entries; joining while others decode."""
    ps = {f"r{i}": prompt(n, seed=20 + i) for i, n in enumerate([5, 8, 9, 17, 33, 26])}
    arrivals = {
        0: [("r0", ps["r0"])],
        2: [("r1", ps["r1"]), ("r2", ps["r2"])],
        5: [("r3", ps["r3"])],
        6: [("r4", ps["r4"]), ("r5", ps["r5"])],
    }
    toks, logits, engine, _ = run_engine(v4_dir, arrivals, kv_pages=64, page_size=16, max_num_seqs=8)
    assert engine.runner.decode_apart and engine.mixed_steps > 0
    check(hf, ps, toks, logits)
    all_returned(engine)


def test_chunked_prefill_at_awkward_splits(v4_dir, hf):
    """A 7-token step budget over 4-token pages: prefills split mid-window and mid-compression
    window, across page boundaries, while other requests decode in the same steps."""
    ps = {"a": prompt(23, 31), "b": prompt(40, 32), "c": prompt(13, 33)}
    arrivals = {0: [("a", ps["a"]), ("b", ps["b"])], 3: [("c", ps["c"])]}
    toks, logits, engine, _ = run_engine(
        v4_dir, arrivals, kv_pages=64, page_size=4, max_num_batched_tokens=7, max_num_seqs=4
    )
    check(hf, ps, toks, logits)
    all_returned(engine)


def test_forced_preemption_recomputes_from_zero(v4_dir, hf):
    """14 pages of 4 tokens cannot hold three requests of 30-50 tokens at once: the scheduler
    preempts, every state (pages and slot row) goes back and the request is recomputed."""
    ps = {"a": prompt(30, 41), "b": prompt(27, 42), "c": prompt(21, 43)}
    arrivals = {0: [("a", ps["a"]), ("b", ps["b"])], 2: [("c", ps["c"])]}
    toks, logits, engine, seqs = run_engine(
        v4_dir, arrivals, kv_pages=14, page_size=4, max_num_batched_tokens=11, max_num_seqs=3
    )
    assert sum(s.num_preemptions for s in seqs) > 0, "the small pool should have forced a preemption"
    check(hf, ps, toks, logits)
    all_returned(engine)


def test_more_requests_than_slot_rows_wait_and_reuse_rows(v4_dir, hf):
    """max_num_seqs=2 gives two slot rows: the others wait, then reuse rows nobody cleared."""
    ps = {f"s{i}": prompt(n, seed=50 + i) for i, n in enumerate([11, 18, 9, 25])}
    toks, logits, engine, _ = run_engine(v4_dir, {0: list(ps.items())}, kv_pages=64, page_size=8, max_num_seqs=2)
    assert engine.pool.num_slots == 2
    check(hf, ps, toks, logits)
    all_returned(engine)


def test_state_sizing_reserves_slot_rows_first(v4_dir):
    cfg = DeepseekV4Config.from_dir(v4_dir)
    specs = DeepseekV4.state_specs(cfg)
    row = slot_row_nbytes(specs, torch.float32)
    assert row == sum(s.request_nbytes(torch.float32) for s in specs if not s.paged) > 0
    gb = (64 * row + 100 * 16 * 224 + 1000) / (1 << 30)  # 64 rows, 100 pages of 16 tokens (224 B/token)
    assert pages_for_memory(specs, 16, torch.float32, gb, max_num_seqs=64) == 100
    with pytest.raises(ValueError, match="max-num-seqs"):
        pages_for_memory(specs, 16, torch.float32, 63 * row / (1 << 30), max_num_seqs=64)
    # (the prefix cache's snapshots take rows of their own: test_v4_prefix_cache)
    engine = Engine(
        EngineArgs(
            model=str(v4_dir),
            device="cpu",
            kernel_backend="cpu",
            kv_memory_gb=gb,
            page_size=16,
            max_num_seqs=64,
            enable_prefix_cache=False,
        )
    )
    assert engine.pool.num_pages == 100 and engine.pool.num_slots == 64
    loads = engine.loads()
    assert loads["kv_state_bytes_per_token"] == {"csa_kv": 128.0, "csa_index_k": 64.0, "hca_kv": 32.0}
    assert set(loads["kv_state_bytes_per_request"]) == {"swa_kv", "csa_stage", "csa_index_stage", "hca_stage"}
    assert sum(loads["kv_state_bytes_per_request"].values()) == row
    text = engine.metrics.render().decode()
    name = engine.args.served_model_name  # the checkpoint folder's name by default
    assert f'dsv4:kv_state_bytes_per_token{{model_name="{name}",role="mono",state="csa_kv"}} 128.0' in text
    assert f'dsv4:kv_state_bytes_per_request{{model_name="{name}",role="mono",state="swa_kv"}}' in text


def test_page_size_refusals_and_every_role_takes_v4(v4_dir):
    specs = DeepseekV4.state_specs(DeepseekV4Config.from_dir(v4_dir))
    assert state_refusal(specs, "mono", 16) is None and state_refusal(specs, "mono", 2) is None
    msg = state_refusal(specs, "mono", 6)  # CSA every 4 tokens: neither 6 | 4 nor 4 | 6
    assert msg and "--page-size 6" in msg and "\n" not in msg
    assert (
        state_refusal(specs, "decode", 16) is None and state_refusal(specs, "prefill", 16) is None
    )  # PD moves slot rows
    assert "--page-size 6" in state_refusal(specs, "decode", 6)
    with pytest.raises(ValueError, match="--page-size 6"):
        Engine(EngineArgs(model=str(v4_dir), device="cpu", kernel_backend="cpu", kv_pages=8, page_size=6))
