"""Quantized checkpoints served by the engine against transformers on their dequantized twins
(fp32 on CPU, where the engine dequantizes once at load), and the CUDA form (weights kept
quantized, w8a8 kernels) exercised on CPU through the torch references."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch

from dsv4_engine.checkpoint import dequantize_checkpoint, init_checkpoint
from dsv4_engine.engine import Engine
from dsv4_engine.engine_args import EngineArgs
from dsv4_engine.model_runner import ModelRunner
from dsv4_engine.quant import QuantWeight
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.sequence import Sequence

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def v3_fp8(tmp_path_factory):
    d = tmp_path_factory.mktemp("q3")
    q = init_checkpoint(d / "fp8", preset="tiny", seed=0, quant="fp8")
    return q, dequantize_checkpoint(q, d / "twin")


def prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def engine_greedy(model_dir, ps: list[list[int]], n: int = NEW_TOKENS) -> dict[int, list[int]]:
    engine = Engine(EngineArgs(model=str(model_dir), device="cpu", kernel_backend="cpu", kv_pages=128, page_size=16))
    outs: dict[int, list[int]] = {i: [] for i in range(len(ps))}
    done: set[int] = set()

    def sink_for(i):
        def sink(out):
            outs[i].extend(out.token_ids)
            if out.finished:
                done.add(i)

        return sink

    for i, p in enumerate(ps):
        engine.submit(
            Sequence(f"r{i}", p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), sink=sink_for(i))
        )
    for _ in range(500):
        if len(done) == len(ps):
            break
        engine.step()
    assert len(done) == len(ps), "engine made no progress"
    return outs


def test_v3_fp8_checkpoint_gives_transformers_greedy_tokens_on_its_dequantized_twin(v3_fp8, caplog):
    q, twin = v3_fp8
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(str(twin), dtype=torch.float32).eval()
    ps = prompts(hf.config.vocab_size, [9, 40], seed=3)
    with caplog.at_level(logging.INFO, logger="dsv4.engine"):
        outs = engine_greedy(q, ps)
    for i, p in enumerate(ps):
        assert outs[i] == hf_greedy(hf, p, NEW_TOKENS), i
    # the startup lines say what was read in which format, and what it occupies
    text = caplog.text
    assert "fp8 e4m3 block [128, 128] (float scales)" in text and "104 fp8 tensors" in text
    assert "weights resident on cpu" in text and "dequantized once at load" in text


def test_the_quantized_checkpoint_is_smaller_and_deterministic(v3_fp8, tmp_path):
    q, twin = v3_fp8
    again = init_checkpoint(tmp_path / "again", preset="tiny", seed=0, quant="fp8")
    assert (again / "model.safetensors").read_bytes() == (q / "model.safetensors").read_bytes()
    assert (q / "model.safetensors").stat().st_size < 0.35 * (twin / "model.safetensors").stat().st_size


def test_cuda_form_keeps_weights_quantized_and_tracks_the_dense_model(v3_fp8, monkeypatch):
    """What a CUDA engine holds, built on CPU: every fp8 weight stays a QuantWeight, F.linear and
    the experts go through the w8a8 reference, resident bytes are the quantized size."""
    q, _ = v3_fp8
    dense = ModelRunner(q, "float32", "cpu", "torch")
    monkeypatch.setattr("dsv4_engine.quant.load.keep_quantized", lambda device: True)
    kept = ModelRunner(q, "float32", "cpu", "torch")
    L = kept.model.layers[1]
    a, m = L.attn, L.mlp
    kept_quantized = [a.q_a.weight, a.q_b.weight, a.kv_a.weight, a.o.weight, m.w13, m.w2, *m.shared]
    assert all(isinstance(w, QuantWeight) for w in kept_quantized)
    assert not isinstance(m.router.gate, QuantWeight)  # the router ships in float
    rb, db = kept.model.resident_bytes, dense.model.resident_bytes
    assert rb["fp8"] > 0 and db["fp8"] == 0
    # fp8 weights take ~1/4 of their fp32 bytes (+1/32 for per-row scales); kv_b, the embedding,
    # the head and the norms stay dense
    assert sum(rb.values()) < 0.45 * sum(db.values())
    prompt = prompts(kept.cfg.vocab_size, [40], seed=5)[0]
    a, b = engine_greedy_runner(dense, prompt), engine_greedy_runner(kept, prompt)
    # w8a8: every activation is rounded to e4m3 (3 mantissa bits) per 128-group, so the logits move
    # by a few percent of their spread (measured: mean 7%, correlation 0.997); same top token.
    assert 0 < (a - b).abs().mean() / a.std() < 0.15
    assert torch.corrcoef(torch.stack([a, b]))[0, 1] > 0.99
    assert a.argmax() == b.argmax()
    # with activations left unrounded the two agree: the plumbing (F.linear dispatch, concatenated
    # gate|up rows, stacked experts through the expert call) adds nothing
    from dsv4_kernels import reference_quant

    monkeypatch.setattr(
        reference_quant,
        "fp8_act_quant",
        lambda x, group=128: (x.float(), torch.ones(x.shape[0], -(-x.shape[1] // group))),
    )
    torch.testing.assert_close(engine_greedy_runner(kept, prompt), a, atol=1e-4, rtol=1e-4)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dsv4_cli", *args], capture_output=True, text=True, timeout=120)


def test_unknown_quantization_stops_serve_with_one_line(v3_fp8, tmp_path):
    import json
    import shutil

    bad = tmp_path / "awq"
    shutil.copytree(v3_fp8[1], bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
    (bad / "config.json").write_text(json.dumps(cfg))
    r = _cli("serve", "--model", str(bad), "--port", "1")
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "'awq'" in lines[0], r.stderr
    r = _cli("model", "init", str(tmp_path / "x"), "--preset", "tiny", "--quant", "fp4-experts")
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1 and "V4" in r.stderr, r.stderr


# ---- DeepSeek-V4 ---------------------------------------------------------------------------------

V4_NEW_TOKENS = 12


@pytest.fixture(scope="module", params=["fp8", "fp4-experts"])
def v4_quant(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("q4")
    q = init_checkpoint(d / request.param, preset="v4-tiny", seed=0, quant=request.param)
    return request.param, q, dequantize_checkpoint(q, d / "twin")


def hf_v4_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy tokens, the prompt in one forward then one token at a time."""
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
        cache, toks = out.past_key_values, [int(out.logits[0, -1].argmax())]
        for _ in range(n - 1):
            out = hf(torch.tensor([[toks[-1]]]), cache=cache, use_cache=True)
            cache = out.past_key_values
            toks.append(int(out.logits[0, -1].argmax()))
    return toks


def test_v4_quantized_checkpoint_gives_transformers_greedy_tokens_on_its_dequantized_twin(v4_quant, caplog):
    quant, q, twin = v4_quant
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(str(twin), dtype=torch.float32).eval()
    ps = prompts(hf.config.vocab_size, [9, 37], seed=4)  # the longer one crosses every window and compression
    with caplog.at_level(logging.INFO, logger="dsv4.engine"):
        outs = engine_greedy(q, ps, V4_NEW_TOKENS)
    for i, p in enumerate(ps):
        assert outs[i] == hf_v4_greedy(hf, p, V4_NEW_TOKENS), (quant, i)
    assert "(ue8m0 scales)" in caplog.text
    assert ("fp4 e2m1 routed experts" in caplog.text) == (quant == "fp4-experts")


def test_v4_cuda_form_keeps_experts_quantized(v4_quant, monkeypatch):
    """V4's weights as a CUDA engine holds them, built on CPU: experts packed fp4 (half a byte per
    value) or fp8, run by the grouped expert call; projections fp8 through F.linear."""
    quant, q, _ = v4_quant
    dense = ModelRunner(q, "float32", "cpu", "torch")
    monkeypatch.setattr("dsv4_engine.quant.load.keep_quantized", lambda device: True)
    kept = ModelRunner(q, "float32", "cpu", "torch")
    L = kept.model.layers[2]
    fp4 = quant == "fp4-experts"
    w13, w2 = L.ffn.w13, L.ffn.w2
    assert (w13.kind, w2.kind) == (("fp4", "fp4") if fp4 else ("fp8", "fp8"))
    if fp4:
        assert w13.data.dtype == torch.uint8 and w13.data.shape[-1] * 2 == w13.shape[-1]
    # a sliding layer's fused input projection (wq_a | wkv) stays fp8; where the layer also fuses
    # its bf16 compressor into that matmul, the fused weight is dense (one format per matmul)
    L0 = kept.model.layers[0]
    assert L0.attn.rate == 0 and L0.attn.w_in.kind == "fp8" and L0.attn.wq_a.kind == "fp8"  # sliding
    assert isinstance(L.attn.w_in, torch.Tensor) and L.attn.wo_b.kind == "fp8"
    rb = kept.model.resident_bytes
    assert rb["fp8"] > 0 and (rb["fp4"] > 0) == fp4
    assert sum(rb.values()) < 0.6 * sum(dense.model.resident_bytes.values())
    prompt = prompts(kept.cfg.vocab_size, [20], seed=6)[0]
    a, b = engine_greedy_runner(dense, prompt), engine_greedy_runner(kept, prompt)
    # w8a8 on the fp8 projections moves the logits a little (fp4 experts are w4a16: exact products)
    assert torch.corrcoef(torch.stack([a, b]))[0, 1] > 0.98
    # with activations left unrounded the kept-quantized model is the dense one: the plumbing
    # (the grouped expert call, concatenated w1|w3, F.linear dispatch) adds nothing
    from dsv4_kernels import reference_quant

    monkeypatch.setattr(
        reference_quant,
        "fp8_act_quant",
        lambda x, group=128: (x.float(), torch.ones(x.shape[0], -(-x.shape[1] // group))),
    )
    torch.testing.assert_close(engine_greedy_runner(kept, prompt), a, atol=1e-4, rtol=1e-4)


def engine_greedy_runner(runner, prompt: list[int]) -> torch.Tensor:
    """The logits after one prefill through a runner and its pool (slot rows included)."""
    from dsv4_engine.kv_cache import KVPool
    from dsv4_engine.scheduler import Scheduler

    pool = KVPool(runner.state_specs, 16, 16, torch.float32, torch.device("cpu"), 4)
    sched = Scheduler(pool.allocator, 16, 4, 1024, pool.slots)
    seq = Sequence("a", prompt, SamplingParams(max_tokens=4, temperature=0))
    sched.add(seq)
    return runner.forward(sched.schedule(), pool)[0]
