"""`dsv4 bench kv-fp8`: what `--kv-cache-dtype fp8_e4m3` changes in the output (issue 46).

The same checkpoint, prompts and greedy decoding on two engines, one storing the attention KV in
the model's dtype (`auto`) and one in FP8 e4m3 with a scale per entry. Per prompt: whether the
greedy tokens are equal, how many lead tokens agree, and the largest logit difference over the
steps both engines ran on the same tokens (the prompt, then the agreed prefix of the output, so
a divergence does not count the different contexts after it). Also the bytes per token of each
pool (from the engine's own figures). Writes OUT/kv_fp8_<preset>.json.

    python -m bench.suites.kv_fp8_agreement [--preset mla512] [--prompts 16] [--new-tokens 32] [--dtype bfloat16]
    python -m bench.suites.kv_fp8_agreement --preset v4-tiny --mtp-steps 3   # both engines speculating (MTP)

With --dtype bfloat16 (the default: the comparison is FP8 KV against bf16 KV) it also runs the
model in float32 and reports how far bf16 itself is from it on the same prompts, as a yardstick
for the FP8 figures (random tiny checkpoints have near-tied logits: small errors flip tokens).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

import torch

from bench.harness.checkpoints import RESULTS, ensure_model
from bench.harness.report import machine, now_iso, write_json


def run_greedy(
    model_dir: Path,
    kv_cache_dtype: str,
    prompts: list[list[int]],
    new_tokens: int,
    dtype: str,
    backend: str,
    device: str = "cpu",
    mtp_steps: int = 0,
) -> tuple[dict[str, list[int]], dict[str, list[torch.Tensor]], dict]:
    """Greedy tokens and each sampling step's logits per request (all submitted at once, run to
    the end by stepping the engine here: no thread), and the engine's /v1/loads figures. With
    `mtp_steps`, the engine speculates that many MTP drafts a step and only tokens are recorded."""
    from dsv4_engine.engine import Engine
    from dsv4_engine.engine_args import EngineArgs
    from dsv4_engine.sampling_params import SamplingParams
    from dsv4_engine.sequence import Sequence

    engine = Engine(
        EngineArgs(
            model=str(model_dir),
            device=device,
            dtype=dtype,
            kernel_backend=backend,
            kv_cache_dtype=kv_cache_dtype,
            kv_pages=max(64, len(prompts) * 8),
            enable_prefix_cache=False,
            **(dict(speculative_algorithm="mtp", speculative_num_steps=mtp_steps) if mtp_steps else {}),
        )
    )
    logits: dict[str, list[torch.Tensor]] = {}
    forward = engine.runner.forward

    def recording(batch, pool):
        out = forward(batch, pool)
        for i, b in enumerate(batch):
            if b.samples:
                logits.setdefault(b.seq.rid, []).append(out[i].float().clone())
        return out

    if not mtp_steps:  # a verify step's rows are not one per request: tokens only
        engine.runner.forward = recording
    outs: dict[str, list[int]] = {}
    done: set[str] = set()
    for k, prompt in enumerate(prompts):
        rid = f"p{k}"

        def sink(out, rid=rid):
            outs.setdefault(rid, []).extend(out.token_ids)
            if out.finished:
                done.add(rid)

        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        engine.submit(Sequence(rid, prompt, params, sink=sink))
    steps = 0
    while len(done) < len(prompts):
        engine.step()
        steps += 1
        if steps > 100 * (new_tokens + 1) * len(prompts):
            raise RuntimeError("the engine made no progress")
    loads = engine.loads()
    return (
        outs,
        logits,
        {"kv_state_bytes_per_token": loads["kv_state_bytes_per_token"], "kv_sizing": loads["kv_sizing"]},
    )


def compare(
    ref_tokens: dict[str, list[int]],
    ref_logits: dict[str, list[torch.Tensor]],
    tokens: dict[str, list[int]],
    logits: dict[str, list[torch.Tensor]],
) -> dict:
    """Greedy agreement and logit error of `tokens/logits` against the reference, per request
    and over all: logits compared on the steps whose inputs were equal (up to and including
    the first differing token's step)."""
    per = {}
    for rid, ref in ref_tokens.items():
        got = tokens[rid]
        lead = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
        steps = min(lead + 1, len(ref_logits[rid]), len(logits[rid]))
        err = max((float((a - b).abs().max()) for a, b in zip(ref_logits[rid][:steps], logits[rid][:steps])), default=0)
        scale = max(float(t.abs().max()) for t in ref_logits[rid][:steps])
        per[rid] = {
            "equal": got == ref,
            "agreed_tokens": lead,
            "tokens": len(ref),
            "max_logit_error": err,
            "logit_scale": scale,
        }
    first = sorted(float((ref_logits[r][0] - logits[r][0]).abs().max()) for r in ref_tokens)
    n = len(per)
    return {
        "first_token_equal_share": sum(p["agreed_tokens"] > 0 for p in per.values()) / n,
        # the first sampled step (after the prompt's prefill): the same inputs on every prompt
        "first_step_logit_error_median": first[n // 2],
        "first_step_logit_error_max": first[-1],
        "prompts": n,
        "equal_share": sum(p["equal"] for p in per.values()) / n,
        "agreed_token_share": sum(p["agreed_tokens"] for p in per.values()) / sum(p["tokens"] for p in per.values()),
        "max_logit_error": max(p["max_logit_error"] for p in per.values()),
        "max_logit_abs": max(p["logit_scale"] for p in per.values()),
        "per_prompt": per,
    }


def token_agreement(ref_tokens: dict[str, list[int]], tokens: dict[str, list[int]]) -> dict:
    """Greedy agreement of `tokens` with the reference: prompts equal, tokens before a divergence."""
    lead = {
        r: next((i for i, (a, b) in enumerate(zip(ref, tokens[r])) if a != b), min(len(ref), len(tokens[r])))
        for r, ref in ref_tokens.items()
    }
    return {
        "prompts": len(ref_tokens),
        "equal_share": sum(tokens[r] == ref for r, ref in ref_tokens.items()) / len(ref_tokens),
        "agreed_token_share": sum(lead.values()) / sum(len(ref) for ref in ref_tokens.values()),
    }


def measure_mtp(
    model_dir: Path, n_prompts: int, new_tokens: int, dtype: str, backend: str, steps: int, seed: int, device: str
) -> dict:
    """FP8 KV under MTP speculation: its greedy tokens against bf16 (auto) KV under MTP, and
    against FP8 KV without speculation (equal by construction in fp32: every key is read as
    stored, whichever step wrote it; tests/unit/engine/test_spec_decode_fp8_kv.py)."""
    import json

    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    prompts = make_prompts(vocab, n_prompts, seed)
    auto_mtp = run_greedy(model_dir, "auto", prompts, new_tokens, dtype, backend, device, steps)[0]
    fp8_mtp = run_greedy(model_dir, "fp8_e4m3", prompts, new_tokens, dtype, backend, device, steps)[0]
    fp8_plain = run_greedy(model_dir, "fp8_e4m3", prompts, new_tokens, dtype, backend, device)[0]
    return {
        "mtp_steps": steps,
        "fp8_mtp_vs_auto_mtp": token_agreement(auto_mtp, fp8_mtp),
        "fp8_mtp_vs_fp8_plain": token_agreement(fp8_plain, fp8_mtp),
        "prompts": len(prompts),
    }


def make_prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 96, (n,), generator=g).tolist()
    return [torch.randint(2, vocab, (m,), generator=g).tolist() for m in lengths]


def measure(
    model_dir: Path, n_prompts: int, new_tokens: int, dtype: str, backend: str, seed: int = 0, device: str = "cpu"
) -> dict:
    import json

    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    prompts = make_prompts(vocab, n_prompts, seed)
    ref_t, ref_l, ref_loads = run_greedy(model_dir, "auto", prompts, new_tokens, dtype, backend, device)
    fp8_t, fp8_l, fp8_loads = run_greedy(model_dir, "fp8_e4m3", prompts, new_tokens, dtype, backend, device)
    result = compare(ref_t, ref_l, fp8_t, fp8_l)
    if dtype == "bfloat16":  # the yardstick: how far bf16 compute itself is from fp32 on these prompts
        f32_t, f32_l, _ = run_greedy(model_dir, "auto", prompts, new_tokens, "float32", backend, device)
        result["yardstick_bf16_vs_fp32"] = {
            k: v for k, v in compare(f32_t, f32_l, ref_t, ref_l).items() if k != "per_prompt"
        }
    per_token = {
        k: sum(v["kv_state_bytes_per_token"].values()) for k, v in (("auto", ref_loads), ("fp8_e4m3", fp8_loads))
    }
    result["bytes_per_token"] = per_token
    result["bytes_ratio"] = per_token["fp8_e4m3"] / per_token["auto"]
    result["by_state"] = {
        "auto": ref_loads["kv_state_bytes_per_token"],
        "fp8_e4m3": fp8_loads["kv_state_bytes_per_token"],
    }
    return result


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="mla512")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--kernel-backend", default="cpu", choices=("cpu", "torch", "triton"))
    p.add_argument("--device", default="cpu", help="cpu, or cuda (with --kernel-backend triton: the FP8 decode kernel)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS / "kv_fp8")
    p.add_argument(
        "--mtp-steps", type=int, default=0, help="> 0: both engines speculate this many MTP drafts (tokens compared)"
    )
    return p.parse_args(argv)


def main_mtp(a: argparse.Namespace) -> dict:
    from dsv4_engine.checkpoint import init_checkpoint

    model = RESULTS / "models" / f"{a.preset}-seed0-mtp"
    if not (model / "config.json").is_file():
        init_checkpoint(model, preset=a.preset, seed=0, mtp=True)
    result = measure_mtp(model, a.prompts, a.new_tokens, a.dtype, a.kernel_backend, a.mtp_steps, a.seed, a.device)
    report = {"suite": "kv_fp8_agreement", "when": now_iso(), "machine": machine(), "preset": a.preset}
    report.update(dtype=a.dtype, kernel_backend=a.kernel_backend, device=a.device, new_tokens=a.new_tokens, **result)
    a.out.mkdir(parents=True, exist_ok=True)
    suffix = "" if a.device == "cpu" else "_" + a.device.replace(":", "")
    write_json(report, a.out / f"kv_fp8_{a.preset}_{a.dtype}_mtp{a.mtp_steps}{suffix}.json")
    vs_auto, vs_plain = result["fp8_mtp_vs_auto_mtp"], result["fp8_mtp_vs_fp8_plain"]
    print(
        f"{a.preset} {a.dtype} MTP {a.mtp_steps}: FP8 vs bf16 KV greedy equal on {vs_auto['equal_share']:.0%} of "
        f"{result['prompts']} prompts ({vs_auto['agreed_token_share']:.1%} of tokens before a divergence); "
        f"FP8 with vs without MTP equal on {vs_plain['equal_share']:.0%} ({vs_plain['agreed_token_share']:.1%})"
    )
    return report


def main(argv: Optional[list[str]] = None) -> dict:
    a = parse_args(argv)
    if a.mtp_steps:
        return main_mtp(a)
    model = ensure_model(None, a.preset, 0)
    result = measure(model, a.prompts, a.new_tokens, a.dtype, a.kernel_backend, a.seed, a.device)
    report = {
        "suite": "kv_fp8_agreement",
        "when": now_iso(),
        "machine": machine(),
        "preset": a.preset,
        "dtype": a.dtype,
        "kernel_backend": a.kernel_backend,
        "device": a.device,
        "new_tokens": a.new_tokens,
        **{k: v for k, v in result.items() if k != "per_prompt"},
        "per_prompt": result["per_prompt"],
    }
    a.out.mkdir(parents=True, exist_ok=True)
    suffix = "" if a.device == "cpu" else "_" + a.device.replace(":", "")
    write_json(report, a.out / f"kv_fp8_{a.preset}_{a.dtype}{suffix}.json")
    plot_folder(a.out)
    print(
        f"{a.preset} {a.dtype}: greedy equal on {result['equal_share']:.0%} of {result['prompts']} prompts, "
        f"{result['agreed_token_share']:.1%} of tokens before a divergence; first-step logit error median "
        f"{result['first_step_logit_error_median']:.4f}, max {result['first_step_logit_error_max']:.4f}; max logit error "
        f"{result['max_logit_error']:.4f} (logits up to {result['max_logit_abs']:.1f}); bytes/token "
        f"{result['bytes_per_token']['auto']:.0f} -> {result['bytes_per_token']['fp8_e4m3']:.0f} "
        f"({result['bytes_ratio']:.3f}x)"
    )
    return report


def plot_folder(out: Path) -> None:
    """kv_fp8.png from every bf16 run in `out`: FP8 KV's first-step logit error beside bf16
    compute's own error against fp32 on the same prompts, and the KV bytes per token."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [json.loads(f.read_text()) for f in sorted(out.glob("kv_fp8_*_bfloat16.json"))]
    runs = [r for r in runs if "yardstick_bf16_vs_fp32" in r]
    if not runs:
        return
    names = [r["preset"] for r in runs]
    xs = range(len(runs))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.bar([x - 0.2 for x in xs], [r["first_step_logit_error_median"] for r in runs], 0.4, label="FP8 KV vs bf16 KV")
    ax1.bar(
        [x + 0.2 for x in xs],
        [r["yardstick_bf16_vs_fp32"]["first_step_logit_error_median"] for r in runs],
        0.4,
        label="bf16 vs fp32 compute (yardstick)",
    )
    ax1.set_title("first-step logit error, median over prompts")
    ax2.bar([x - 0.2 for x in xs], [r["bytes_per_token"]["auto"] for r in runs], 0.4, label="bf16 KV")
    ax2.bar([x + 0.2 for x in xs], [r["bytes_per_token"]["fp8_e4m3"] for r in runs], 0.4, label="FP8 KV (+ scales)")
    ax2.set_title("attention KV bytes per token")
    for ax in (ax1, ax2):
        ax.set_xticks(list(xs))
        ax.set_xticklabels(names)
        ax.legend(fontsize=8)
    fig.suptitle("--kv-cache-dtype fp8_e4m3 on CPU (random tiny checkpoints; bench/suites/kv_fp8_agreement.py)")
    fig.tight_layout()
    fig.savefig(out / "kv_fp8.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
