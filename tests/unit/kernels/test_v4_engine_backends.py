"""The V4 engine on `--kernel-backend triton` (the Triton interpreter on CPU) against the torch
backend and transformers' DeepseekV4ForCausalLM on v4-tiny in fp32: the real engine loop
(scheduler, pool, model runner) with staggered arrivals, chunked prefill at awkward splits and
decodes in the same steps; greedy tokens equal, logits close. The model's kernel path also runs
on the pure-torch twins of the kernels (dsv4_kernels.reference_v4), which pins the references'
semantics to the model's."""

from __future__ import annotations

import pytest
import torch

from dsv4_engine.engine import Engine
from dsv4_engine.engine_args import EngineArgs
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.sequence import Sequence

transformers = pytest.importorskip("transformers")

TOL = 1e-4
NEW_TOKENS = 4


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def v4_dir(make_model):
    return make_model("v4-tiny")


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [0] + torch.randint(2, 500, (n - 1,), generator=g).tolist()


# 17 tokens: past the window (8), two HCA windows (8) and four CSA windows (4) with top-4, so the
# indexer drops entries; 9 joins while 17 prefills in 7-token steps, then both decode.
PROMPTS = {"a": prompt(17, 41), "b": prompt(9, 43)}
ARRIVALS = {0: ["a"], 1: ["b"]}


def run(v4_dir, backend: str, kernel_ops=None, prompts=None, arrivals=None, new_tokens=NEW_TOKENS, kv_cache_dtype=None):
    """Greedy tokens and the logits each was sampled from, per request; the engine."""
    prompts, arrivals = prompts or PROMPTS, arrivals or ARRIVALS
    engine = Engine(
        EngineArgs(
            model=str(v4_dir),
            device="cpu",
            kernel_backend=backend,
            kv_pages=64,
            page_size=4,
            max_num_batched_tokens=7,
            max_num_seqs=4,
            kv_cache_dtype=kv_cache_dtype,
        )
    )
    if kernel_ops is not None:
        engine.runner.model.kops = kernel_ops
    toks: dict[str, list[int]] = {}
    logits: dict[str, list[torch.Tensor]] = {}
    forward = engine.runner.forward

    def recording_forward(batch, pool):
        out = forward(batch, pool)
        for b, row in zip(batch, out):
            if b.samples:
                logits.setdefault(b.seq.rid, []).append(row.clone())
        return out

    engine.runner.forward = recording_forward
    done: set[str] = set()

    def sink(out):
        toks.setdefault(out.rid, []).extend(out.token_ids)
        if out.finished:
            done.add(out.rid)

    step = 0
    while len(done) < len(prompts):
        for rid in arrivals.get(step, []):
            params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
            engine.submit(Sequence(rid, prompts[rid], params, sink=sink))
        engine.step()
        step += 1
        assert step < 500, "engine made no progress"
    return toks, {rid: torch.stack(v) for rid, v in logits.items()}, engine


@pytest.fixture(scope="module")
def torch_run(v4_dir):
    return run(v4_dir, "torch")


def transformers_logits(v4_dir, prompts, new_tokens=NEW_TOKENS):
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(str(v4_dir), dtype=torch.float32).eval()
    want = {}
    with torch.no_grad():
        for rid, p in prompts.items():
            out = hf(torch.tensor([p]), use_cache=True)
            cache, lg = out.past_key_values, [out.logits[0, -1]]
            for _ in range(new_tokens - 1):
                out = hf(lg[-1].argmax().view(1, 1), cache=cache, use_cache=True)
                cache = out.past_key_values
                lg.append(out.logits[0, -1])
            want[rid] = torch.stack(lg)
    return want


@pytest.fixture(scope="module")
def oracle(v4_dir):
    return transformers_logits(v4_dir, PROMPTS)


def check(got, want_toks, want_logits, oracle):
    toks, logits, engine = got
    assert engine.runner.model.kops is not None
    for rid in oracle:
        assert toks[rid] == want_toks[rid] == oracle[rid].argmax(-1).tolist(), rid
        assert float((logits[rid] - want_logits[rid]).abs().max()) < TOL, rid
        assert float((logits[rid] - oracle[rid]).abs().max()) < TOL, rid


def test_torch_backend_keeps_the_models_torch_path(torch_run, oracle):
    toks, logits, engine = torch_run
    assert engine.runner.model.kops is None
    for rid in PROMPTS:
        assert toks[rid] == oracle[rid].argmax(-1).tolist()


def test_kernel_path_on_the_torch_references_matches(v4_dir, torch_run, oracle):
    from dsv4_kernels import reference

    check(run(v4_dir, "torch", kernel_ops=reference), torch_run[0], torch_run[1], oracle)


def test_triton_backend_matches_torch_backend_and_transformers(v4_dir, torch_run, oracle):
    got = run(v4_dir, "triton")
    assert engine_backend(got) == "triton"
    check(got, torch_run[0], torch_run[1], oracle)


def engine_backend(got) -> str:
    return got[2].runner.kernel_backend


@pytest.mark.slow
def test_triton_backend_three_requests_longer_prompts(v4_dir):
    """33 tokens (past every window and compression boundary, 8 CSA entries for top-4), 18 and 9,
    staggered, 7-token prefill steps next to decodes, 6 greedy tokens each."""
    prompts = {"a": prompt(33, 51), "b": prompt(18, 52), "c": prompt(9, 53)}
    arrivals = {0: ["a", "b"], 3: ["c"]}
    want = transformers_logits(v4_dir, prompts, 6)
    base = run(v4_dir, "torch", prompts=prompts, arrivals=arrivals, new_tokens=6)
    check(run(v4_dir, "triton", prompts=prompts, arrivals=arrivals, new_tokens=6), base[0], base[1], want)


def test_one_forward_mixing_chunks_and_decode_tokens(v4_dir):
    """The engine splits decodes from prefills, but the model takes any mix in one forward: a
    request's chunks next to another's decode tokens, kernel path (Triton) against the torch
    path, step by step from identical states."""
    from dsv4_engine.models.deepseek_v4 import DeepseekV4, allocate_states
    from dsv4_engine.models.deepseek_v4_config import DeepseekV4Config
    from dsv4_engine.models.deepseek_v4_weights import load_v4_weights
    from dsv4_engine.models.forward_batch import V4Batch
    from dsv4_kernels.api import get_ops

    cfg = DeepseekV4Config.from_dir(v4_dir)
    weights = load_v4_weights(v4_dir)
    fast, plain = DeepseekV4(cfg, weights, get_ops("triton")), DeepseekV4(cfg, weights, get_ops("cpu"))
    assert fast.kops is not None and plain.kops is None
    page = 4
    states = allocate_states(DeepseekV4.state_specs(cfg), 32, page, 4, torch.float32)
    for t in states.values():
        t.normal_()  # nothing may read state it did not write
    twin = {k: v.clone() for k, v in states.items()}
    a, b = prompt(20, 61), prompt(9, 62)
    done = {"a": 0, "b": 0}
    tables = {"a": list(range(0, 8)), "b": list(range(8, 16))}
    slots = {"a": 2, "b": 0}
    plans = [{"b": 9}, {"a": 7, "b": 1}, {"a": 13, "b": 1}]  # a's chunks end mid-window and past them
    toks = {"a": list(a), "b": list(b)}
    for plan in plans:
        ids, pos, lens, last = [], [], [], []
        for rid, n in plan.items():
            s = done[rid]
            ids += toks[rid][s : s + n]
            pos += range(s, s + n)
            lens.append(n)
            last.append(len(ids) - 1)
        fb = V4Batch(
            torch.tensor(ids),
            torch.tensor(pos),
            torch.tensor(lens),
            torch.tensor(last),
            torch.tensor([tables[r] for r in plan], dtype=torch.int32),
            torch.tensor([slots[r] for r in plan]),
            page,
        )
        got, want = fast.forward(fb, states), plain.forward(fb, twin)
        assert float((got - want).abs().max()) < TOL
        for (rid, n), lg in zip(plan.items(), want):
            done[rid] += n
            if done[rid] >= len(toks[rid]):
                toks[rid].append(int(lg.argmax()))


@pytest.mark.slow
def test_triton_backend_reads_fp8_kv_as_the_torch_backend_does(v4_dir):
    """--kv-cache-dtype fp8_e4m3 on the kernel path: the Triton attention and indexer read the
    ring, entries and indexer keys as packed e4m3 rows + scales, in place; the torch backend
    decodes the same rows. Greedy tokens equal, logits within fp32's bound: both read every key
    as stored (a chunk's own keys included), so no value lands on another e4m3 step."""
    got = run(v4_dir, "triton", kv_cache_dtype="fp8_e4m3")
    want = run(v4_dir, "torch", kv_cache_dtype="fp8_e4m3")
    assert got[2].runner.model.kops is not None and got[2].kv_cache_dtype == "fp8_e4m3"
    for rid in PROMPTS:
        assert got[0][rid] == want[0][rid], rid
        assert float((got[1][rid] - want[1][rid]).abs().max()) < TOL, rid
