"""Self-distillation of a checkpoint's MTP layer (`dsv4 model init --train-mtp`).

A randomly initialised MTP layer drafts noise, so speculation would accept nothing. This trains
the layer for a few CPU minutes on the model's own greedy continuations: the engine (without
speculation) continues random prompts greedily; the main model's final-normed hidden states of
those sequences are the layer's inputs (as at serving time), and at each position i it learns
the main model's distribution at position i+1 (soft cross-entropy), i.e. the token after next.
The embedding and the output head stay the main model's copies; routing (gate, bias) stays as
initialised. The layer's forward here is a plain differentiable torch version of the engine's
(MLA in per-head form, experts computed densely and weighted by the routing).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger("dsv4.train_mtp")

TRAINED = (
    "enorm",
    "hnorm",
    "eh_proj",
    "shared_head.norm",
    "self_attn",
    "input_layernorm",
    "post_attention_layernorm",
    "mlp.experts",
    "mlp.shared_experts",
)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved pairs rotated (the engine's convention); x [..., T, R], cos/sin [T, R/2]."""
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)


class TrainableMTP:
    """The MTP block's float weights as leaf tensors, and its forward over whole sequences."""

    def __init__(self, cfg, weights: dict[str, torch.Tensor], layer: int, model):
        self.cfg, self.p, self.model = cfg, f"model.layers.{layer}.", model
        self.w = {k[len(self.p) :]: v.float().clone() for k, v in weights.items() if k.startswith(self.p)}
        self.params = [v.requires_grad_() for k, v in self.w.items() if k.startswith(TRAINED)]

    def forward(self, next_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """next_ids [T] (token i+1 at position i), hidden [T, D] -> logits [T, V] (one sequence)."""
        cfg, w, m = self.cfg, self.w, self.model
        eps, T = cfg.rms_norm_eps, next_ids.shape[0]
        H, nope, R, v, C = (
            cfg.num_attention_heads,
            cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim,
            cfg.v_head_dim,
            cfg.kv_lora_rank,
        )
        e = _rms(F.embedding(next_ids, m.embed.float()), w["enorm.weight"], eps)
        x = F.linear(torch.cat([e, _rms(hidden, w["hnorm.weight"], eps)], -1), w["eh_proj.weight"])
        h = _rms(x, w["input_layernorm.weight"], eps)
        if cfg.q_lora_rank:
            q = F.linear(
                _rms(F.linear(h, w["self_attn.q_a_proj.weight"]), w["self_attn.q_a_layernorm.weight"], eps),
                w["self_attn.q_b_proj.weight"],
            )
        else:
            q = F.linear(h, w["self_attn.q_proj.weight"])
        q = q.view(T, H, nope + R).transpose(0, 1)  # [H, T, nope+R]
        ckv = F.linear(h, w["self_attn.kv_a_proj_with_mqa.weight"])
        latent = _rms(ckv[:, :C], w["self_attn.kv_a_layernorm.weight"], eps)
        cos, sin = m.cos[:T].float(), m.sin[:T].float()
        k_rope = _rope(ckv[:, C:], cos, sin)  # [T, R]
        q = torch.cat([q[..., :nope], _rope(q[..., nope:], cos, sin)], -1)
        kv = F.linear(latent, w["self_attn.kv_b_proj.weight"]).view(T, H, nope + v).transpose(0, 1)
        k = torch.cat([kv[..., :nope], k_rope.expand(H, T, R)], -1)
        o = F.scaled_dot_product_attention(q, k, kv[..., nope:], is_causal=True, scale=m.scale)
        x = F.linear(o.transpose(0, 1).reshape(T, H * v), w["self_attn.o_proj.weight"]) + x
        h = _rms(x, w["post_attention_layernorm.weight"], eps)
        x = self._moe(h) + x
        return F.linear(_rms(x, w["shared_head.norm.weight"], eps), m.lm_head.float())

    def _moe(self, h: torch.Tensor) -> torch.Tensor:
        cfg, w = self.cfg, self.w
        if "mlp.gate.weight" not in w:
            return self._mlp(h, "mlp.")
        with torch.no_grad():
            weights, ids = self.model.ops.moe_route(
                F.linear(h.float(), w["mlp.gate.weight"]),
                w["mlp.gate.e_score_correction_bias"],
                cfg.n_group,
                cfg.topk_group,
                cfg.num_experts_per_tok,
                cfg.norm_topk_prob,
                cfg.routed_scaling_factor,
            )
        out = torch.zeros_like(h)
        for e in range(cfg.n_routed_experts):
            gate = (weights * (ids == e)).sum(-1, keepdim=True)  # [T, 1], 0 where not routed
            if bool((gate != 0).any()):
                out = out + gate * self._mlp(h, f"mlp.experts.{e}.")
        if cfg.n_shared_experts:
            out = out + self._mlp(h, "mlp.shared_experts.")
        return out

    def _mlp(self, h: torch.Tensor, p: str) -> torch.Tensor:
        w = self.w
        return F.linear(
            F.silu(F.linear(h, w[p + "gate_proj.weight"])) * F.linear(h, w[p + "up_proj.weight"]),
            w[p + "down_proj.weight"],
        )


def _greedy_continuations(model_dir: Path, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """prompt + the model's greedy continuation, for each prompt (the engine, no speculation)."""
    from dsv4_engine.engine import Engine
    from dsv4_engine.engine_args import EngineArgs
    from dsv4_engine.sampling_params import SamplingParams
    from dsv4_engine.sequence import Sequence

    engine = Engine(
        EngineArgs(
            model=str(model_dir),
            device="cpu",
            kernel_backend="torch",
            kv_pages=1024,
            max_num_seqs=64,
            enable_prefix_cache=False,
        )
    )
    out: dict[str, list[int]] = {}
    done = threading.Event()

    def sink(o):
        out.setdefault(o.rid, []).extend(o.token_ids)
        if o.finished and len([r for r in out if r.endswith(":done")]) + 1 == len(prompts):
            done.set()
        if o.finished:
            out[o.rid + ":done"] = []

    engine.start()
    try:
        for i, p in enumerate(prompts):
            engine.submit(
                Sequence(f"s{i}", p, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True), sink=sink)
            )
        if not done.wait(1800):
            raise RuntimeError("greedy continuations did not finish")
    finally:
        engine.stop()
    return [p + out[f"s{i}"] for i, p in enumerate(prompts)]


@torch.no_grad()
def _hidden_and_logits(model, seq: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The main model's final-normed hidden states [T, D] and logits [T, V] of one sequence."""
    from dsv4_engine.batch_buffers import host_batch
    from dsv4_engine.models.forward_batch import ForwardBatch

    page = 16
    n_pages = -(-len(seq) // page)
    states = {model.LATENT_KV: torch.zeros(n_pages, model.cfg.num_hidden_layers, page, model.cfg.kv_cache_dim)}
    hb = host_batch([0], [len(seq)], [list(range(n_pages))], [seq], [None], page)
    t = {
        k: torch.from_numpy(getattr(hb, k))
        for k in ("input_ids", "positions", "slot_mapping", "block_table", "seq_lens", "extend_lens", "logits_indices")
    }
    fb = ForwardBatch(**t, all_decode=False, page_size=page, seq_lens_host=[len(seq)], extend_lens_host=[len(seq)])
    h = model.hidden_states(fb, states)
    return h.float(), F.linear(h, model.lm_head).float()


def train_mtp(
    model_dir: str | Path,
    steps: int = 600,
    num_prompts: int = 128,
    prompt_len: int = 24,
    new_tokens: int = 96,
    lr: float = 2e-3,
    seed: int = 0,
    batch: int = 2,
) -> dict:
    """Train the checkpoint's MTP layer in place (model.safetensors rewritten); returns a report
    (steps, seconds, held-out next-next-token agreement with the target before and after)."""
    from safetensors.torch import load_file, save_file

    from dsv4_engine.config import ModelConfig
    from dsv4_engine.model_runner import get_ops
    from dsv4_engine.models.deepseek_v3 import DeepseekV3
    from dsv4_engine.weights import load_weights

    d = Path(model_dir)
    import json

    if json.loads((d / "config.json").read_text()).get("model_type") != "deepseek_v3":
        raise ValueError(
            "--train-mtp trains DeepSeek-V3's MTP layer; DeepSeek-V4 presets are not supported yet "
            "(use --mtp for an untrained V4 MTP block)"
        )
    cfg = ModelConfig.from_dir(d)
    if not cfg.extra.get("num_nextn_predict_layers"):
        raise ValueError("--train-mtp needs an MTP layer (add --mtp)")
    if cfg.extra.get("quantization_config"):
        raise ValueError("--train-mtp trains float weights: quantize afterwards, not with --quant")
    t0 = time.monotonic()
    g = torch.Generator().manual_seed(seed)
    # Prompts: random ids from the tokenizer's ordinary range (past the special tokens).
    prompts = [torch.randint(3, cfg.vocab_size, (prompt_len,), generator=g).tolist() for _ in range(num_prompts)]
    seqs = _greedy_continuations(d, prompts, new_tokens)
    model = DeepseekV3(cfg, load_weights(d), get_ops("torch"), torch.float32, torch.device("cpu"))
    data = [(torch.tensor(s), *_hidden_and_logits(model, s)) for s in seqs]
    held_out, train = data[: max(1, len(data) // 8)], data[max(1, len(data) // 8) :]
    weights = load_file(str(d / "model.safetensors"))
    mtp = TrainableMTP(cfg, weights, cfg.num_hidden_layers, model)
    opt = torch.optim.Adam(mtp.params, lr=lr)

    def example(ids, hidden, logits):
        # Position i (i + 2 < T): inputs h_i and token i+1, target the model's distribution at i+1.
        return mtp.forward(ids[1:-1], hidden[:-2]), logits[1:-1]

    def agreement(rows) -> float:
        hit = total = 0
        with torch.no_grad():
            for ids, hidden, logits in rows:
                pred, tgt = example(ids, hidden, logits)
                sl = slice(prompt_len - 1, None)  # positions whose next-next token is generated
                hit += int((pred[sl].argmax(-1) == tgt[sl].argmax(-1)).sum())
                total += pred[sl].shape[0]
        return hit / max(total, 1)

    before = agreement(held_out)
    for step in range(steps):
        opt.zero_grad()
        for j in range(batch):  # `batch` sequences a step, gradients summed
            ids, hidden, logits = train[(step * batch + j) % len(train)]
            pred, tgt = example(ids, hidden, logits)
            loss = -(F.softmax(tgt, -1) * F.log_softmax(pred, -1)).sum(-1).mean() / batch
            loss.backward()
        opt.step()
        if step % 50 == 0:
            log.info("train-mtp step %d loss %.3f", step, loss.item())
    after = agreement(held_out)
    for k, v in mtp.w.items():
        weights[mtp.p + k] = v.detach().contiguous()
    tmp = d / "model.safetensors.tmp"
    save_file(weights, str(tmp), metadata={"format": "pt"})
    tmp.replace(d / "model.safetensors")
    report = {
        "steps": steps,
        "seconds": round(time.monotonic() - t0, 1),
        "sequences": len(seqs),
        "held_out_top1_agreement_before": round(before, 4),
        "held_out_top1_agreement_after": round(after, 4),
    }
    if not math.isfinite(loss.item()):
        raise RuntimeError(f"--train-mtp diverged: {report}")
    return report
