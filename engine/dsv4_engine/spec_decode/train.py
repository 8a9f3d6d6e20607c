"""Making speculation accept drafts on a tiny preset: `dsv4 model init --train --train-mtp`.

A random model's greedy continuations are close to a hash of the context, which no one-layer
drafter can learn, and a random MTP layer drafts noise. `--train` (`train_base`) trains the main
model for a few CPU minutes on the shipped corpus (the tokenizer's training text), so that its
continuations have structure. `--train-mtp` (`train_mtp`) then self-distils the MTP layer: the
engine (without speculation) continues corpus prompts greedily; the main model's final-normed
hidden states of those sequences are the layer's inputs (as at serving time), and at each
position i it learns the main model's distribution at position i+1 (soft cross-entropy), i.e.
the token after next. The embedding and the output head stay the main model's; routing (gate,
bias) stays as initialised. The forwards here are plain differentiable torch versions of the
engine's (MLA in per-head form, each expert over the tokens routed to it), checked against it.

Both model families train through the same loops (`train_base`, `train_mtp`); what differs (the
differentiable forwards, where the block's inputs come from, how the block is seeded and which
copies follow the main model) is a family's kit: `V3Kit` here, `V4Kit` in
dsv4_engine.spec_decode.train_v4 (DeepSeek-V4's whole-sequence forwards).
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from pathlib import Path
from typing import Optional

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


def decoder_layer(cfg, w: dict, p: str, x: torch.Tensor, model) -> torch.Tensor:
    """One decoder layer (attention + MLP/MoE, pre-norm residuals) over x [B, T, D]: weights
    `w[p + name]`, rope tables and the softmax scale from the engine's `model`."""
    eps, (B, T, _) = cfg.rms_norm_eps, x.shape
    H, nope, R, v, C = (
        cfg.num_attention_heads,
        cfg.qk_nope_head_dim,
        cfg.qk_rope_head_dim,
        cfg.v_head_dim,
        cfg.kv_lora_rank,
    )
    h = _rms(x, w[p + "input_layernorm.weight"], eps)
    if cfg.q_lora_rank:
        q = F.linear(
            _rms(F.linear(h, w[p + "self_attn.q_a_proj.weight"]), w[p + "self_attn.q_a_layernorm.weight"], eps),
            w[p + "self_attn.q_b_proj.weight"],
        )
    else:
        q = F.linear(h, w[p + "self_attn.q_proj.weight"])
    q = q.view(B, T, H, nope + R).transpose(1, 2)  # [B, H, T, nope+R]
    ckv = F.linear(h, w[p + "self_attn.kv_a_proj_with_mqa.weight"])
    latent = _rms(ckv[..., :C], w[p + "self_attn.kv_a_layernorm.weight"], eps)
    cos, sin = model.rope.cos[:T].float(), model.rope.sin[:T].float()
    k_rope = _rope(ckv[..., C:], cos, sin).unsqueeze(1)  # [B, 1, T, R]
    q = torch.cat([q[..., :nope], _rope(q[..., nope:], cos, sin)], -1)
    kv = F.linear(latent, w[p + "self_attn.kv_b_proj.weight"]).view(B, T, H, nope + v).transpose(1, 2)
    k = torch.cat([kv[..., :nope], k_rope.expand(B, H, T, R)], -1)
    o = F.scaled_dot_product_attention(q, k, kv[..., nope:], is_causal=True, scale=model.layers[0].attn.scale)
    x = F.linear(o.transpose(1, 2).reshape(B, T, H * v), w[p + "self_attn.o_proj.weight"]) + x
    h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
    return _moe(cfg, w, p, h.reshape(B * T, -1), model).view(B, T, -1) + x


def _moe(cfg, w: dict, p: str, h: torch.Tensor, model) -> torch.Tensor:
    """The MLP of a dense layer, or a MoE layer: each expert over the tokens routed to it,
    weighted by the routing (which is not trained: gate and bias stay as initialised)."""
    if p + "mlp.gate.weight" not in w:
        return _mlp(w, p + "mlp.", h)
    with torch.no_grad():
        weights, ids = model.ops.moe_route(
            F.linear(h.float(), w[p + "mlp.gate.weight"]),
            w[p + "mlp.gate.e_score_correction_bias"],
            cfg.n_group,
            cfg.topk_group,
            cfg.num_experts_per_tok,
            cfg.norm_topk_prob,
            cfg.routed_scaling_factor,
        )
    out = torch.zeros_like(h)
    for e in range(cfg.n_routed_experts):
        gate = (weights * (ids == e)).sum(-1)  # [N], 0 where not routed
        rows = gate.nonzero().squeeze(-1)  # the tokens routed to e: only those are computed
        if rows.numel():
            out = out.index_add(0, rows, gate[rows, None] * _mlp(w, f"{p}mlp.experts.{e}.", h[rows]))
    if cfg.n_shared_experts:
        out = out + _mlp(w, p + "mlp.shared_experts.", h)
    return out


def _mlp(w: dict, p: str, h: torch.Tensor) -> torch.Tensor:
    return F.linear(
        F.silu(F.linear(h, w[p + "gate_proj.weight"])) * F.linear(h, w[p + "up_proj.weight"]),
        w[p + "down_proj.weight"],
    )


class TrainableMTP:
    """The MTP block's float weights as leaf tensors, and its forward over whole sequences."""

    def __init__(self, cfg, weights: dict[str, torch.Tensor], layer: int, model):
        self.cfg, self.p, self.model = cfg, f"model.layers.{layer}.", model
        self.w = {k: v.float().clone() for k, v in weights.items() if k.startswith(self.p)}
        self.params = [v.requires_grad_() for k, v in self.w.items() if k[len(self.p) :].startswith(TRAINED)]

    def forward(self, next_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """next_ids [(B,) T] (token i+1 at position i), hidden [(B,) T, D] -> logits [(B,) T, V]."""
        if next_ids.dim() == 1:
            return self.forward(next_ids[None], hidden[None])[0]
        return self.forward_with_hidden(next_ids, hidden)[0]

    def forward_with_hidden(self, next_ids: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, T] and [B, T, D] -> (logits [B, T, V], the block's output hidden state [B, T, D]:
        what the draft chain feeds back as the next position's hidden)."""
        cfg, w, m, p = self.cfg, self.w, self.model, self.p
        eps = cfg.rms_norm_eps
        e = _rms(F.embedding(next_ids, m.embed.float()), w[p + "enorm.weight"], eps)
        x = F.linear(torch.cat([e, _rms(hidden, w[p + "hnorm.weight"], eps)], -1), w[p + "eh_proj.weight"])
        x = decoder_layer(cfg, w, p, x, m)
        return F.linear(_rms(x, w[p + "shared_head.norm.weight"], eps), m.lm_head.weight.float()), x


class TrainableV3:
    """The main model (embedding, layers, final norm, head) as float leaf tensors, and its
    forward over a batch of whole sequences; the MTP block's tensors are left out."""

    def __init__(self, cfg, weights: dict[str, torch.Tensor], model):
        self.cfg, self.model = cfg, model
        mtp = tuple(f"model.layers.{cfg.num_hidden_layers + i}." for i in range(4))
        self.w = {k: v.float().clone() for k, v in weights.items() if not k.startswith(mtp)}
        self.params = [v.requires_grad_() for k, v in self.w.items() if not k.endswith(BASE_FROZEN)]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T] -> logits [B, T, V]."""
        cfg, w = self.cfg, self.w
        x = F.embedding(ids, w["model.embed_tokens.weight"])
        for i in range(cfg.num_hidden_layers):
            x = decoder_layer(cfg, w, f"model.layers.{i}.", x, self.model)
        return F.linear(_rms(x, w["model.norm.weight"], cfg.rms_norm_eps), w["lm_head.weight"])


BASE_FROZEN = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")  # routing stays as initialised


def corpus_ids(model_dir: str | Path) -> list[int]:
    """The shipped corpus (the tokenizer's training text) as one stream of the checkpoint's
    token ids, lines joined by newlines."""
    from tokenizers import Tokenizer

    from dsv4_engine.checkpoint import corpus_lines

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    return tok.encode("\n".join(corpus_lines()), add_special_tokens=False).ids


def corpus_prompts(model_dir: str | Path, n: int, length: int, seed: int) -> list[list[int]]:
    """`n` windows of `length` tokens at random places in the corpus (the prompts `--train-mtp`
    distils on and the speculation benchmark sends: the distribution the trained model knows)."""
    ids = corpus_ids(model_dir)
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - length, (n,), generator=g).tolist()
    return [ids[s : s + length] for s in starts]


def one_torch_thread(fn):
    """Run fn with one torch thread: at these tiny widths a second OpenMP thread mostly spins,
    and on a loaded 2-core machine a v4-tiny step took ~10x longer with two."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(before)

    return run


@one_torch_thread
def train_base(
    model_dir: str | Path,
    steps: int = 150,
    seq_len: int = 48,
    batch: int = 8,
    lr: float = 5e-3,
    seed: int = 0,
) -> dict:
    """Train the main model (not the MTP block) in place on the shipped corpus, next-token
    cross-entropy on random windows, so that its greedy continuations have structure (a random
    model's are close to a hash of the context, which no drafter can predict). Returns a report
    (steps, seconds, loss at the start and end)."""
    from safetensors.torch import load_file

    kit = family_kit(model_dir, "--train")
    t0 = time.monotonic()
    weights = load_file(str(kit.dir / "model.safetensors"))
    net = kit.base(weights)
    data = torch.tensor(corpus_ids(kit.dir))
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(net.params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=warmup_fraction(steps))
    losses = []
    for step in range(steps):
        starts = torch.randint(0, len(data) - seq_len - 1, (batch,), generator=g)
        win = torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()])
        logits = net.forward(win[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), win[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.params, 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % 50 == 0:
            log.info("train step %d loss %.3f", step, losses[-1])
    if not math.isfinite(losses[-1]):
        raise RuntimeError(f"--train diverged at loss {losses[-1]}")
    _write_back(weights, net.w)
    kit.sync_copies(weights)
    _save(kit.dir, weights)
    tail = losses[-20:]
    return {
        "steps": steps,
        "seconds": round(time.monotonic() - t0, 1),
        "corpus_tokens": len(data),
        "loss_first": round(losses[0], 3),
        "loss_last20_mean": round(sum(tail) / len(tail), 3),
    }


def warmup_fraction(steps: int) -> float:
    """One-cycle warm-up: a tenth of the steps, at least two. OneCycleLR divides by zero when the
    warm-up ends exactly on step 1 (a tenth of 10 steps, half of 2)."""
    return min(0.4, max(0.1, 2 / steps))


def family_kit(model_dir: str | Path, flag: str):
    """The training kit of the checkpoint's model family (float weights only)."""
    import json

    d = Path(model_dir)
    config = json.loads((d / "config.json").read_text())
    if config.get("quantization_config"):
        raise ValueError(f"{flag} trains float weights: quantize afterwards, not with --quant")
    if config.get("model_type") == "deepseek_v4":
        from dsv4_engine.spec_decode.train_v4 import V4Kit

        return V4Kit(d)
    if config.get("model_type") == "deepseek_v3":
        return V3Kit(d)
    raise ValueError(f"{flag} trains DeepSeek-V3 and -V4 checkpoints, not model_type {config.get('model_type')!r}")


class V3Kit:
    """DeepSeek-V3's side of training: the engine's model (for the block's inputs and the rope
    tables), the trainable forwards, and the block's layout (`model.layers.{N}.`)."""

    MTP_LR, MTP_HARD_WEIGHT = 2e-3, 0.0  # train_mtp's recipe (soft targets only: what was measured)

    def __init__(self, d: Path):
        from dsv4_engine.config import ModelConfig
        from dsv4_engine.model_runner import get_ops
        from dsv4_engine.models.deepseek_v3 import DeepseekV3
        from dsv4_engine.weights import load_weights

        self.dir, self.cfg = d, ModelConfig.from_dir(d)
        self.model = DeepseekV3(self.cfg, load_weights(d), get_ops("cpu"), torch.float32, torch.device("cpu"))
        self.num_mtp = int(self.cfg.extra.get("num_nextn_predict_layers") or 0)

    def base(self, weights: dict) -> TrainableV3:
        return TrainableV3(self.cfg, weights, self.model)

    def targets(self, weights: dict, seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The main model's final-normed hidden states [N, T, D] and logits [N, T, V] (the engine's)."""
        rows = [_hidden_and_logits(self.model, s) for s in seqs]
        return torch.stack([h for h, _ in rows]), torch.stack([lg for _, lg in rows])

    def seed_mtp(self, weights: dict) -> None:
        """The block's decoder layer starts from a copy of the main model's last layer."""
        cfg = self.cfg
        last, mtp_p = f"model.layers.{cfg.num_hidden_layers - 1}.", f"model.layers.{cfg.num_hidden_layers}."
        for k in list(weights):
            if k.startswith(last) and mtp_p + k[len(last) :] in weights:
                weights[mtp_p + k[len(last) :]] = weights[k].clone()

    def mtp(self, weights: dict) -> TrainableMTP:
        return TrainableMTP(self.cfg, weights, self.cfg.num_hidden_layers, self.model)

    def sync_copies(self, weights: dict) -> None:
        _sync_mtp_copies(self.cfg, weights)


def _write_back(weights: dict[str, torch.Tensor], trained: dict[str, torch.Tensor]) -> None:
    """Trained tensors back into the checkpoint's dict, in the checkpoint's dtypes."""
    for k, v in trained.items():
        weights[k] = v.detach().to(weights[k].dtype).contiguous()


def _sync_mtp_copies(cfg, weights: dict[str, torch.Tensor]) -> None:
    """The MTP blocks' copies of the embedding and the head (the release keeps them equal to the
    main model's, and the engine reads the copies) set to the main model's current ones."""
    for i in range(int(cfg.extra.get("num_nextn_predict_layers") or 0)):
        p = f"model.layers.{cfg.num_hidden_layers + i}."
        for copy, main in (
            ("embed_tokens.weight", "model.embed_tokens.weight"),
            ("shared_head.head.weight", "lm_head.weight"),
        ):
            if p + copy in weights:
                weights[p + copy] = weights[main].clone()


def _save(d: Path, weights: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    tmp = d / "model.safetensors.tmp"
    save_file(weights, str(tmp), metadata={"format": "pt"})
    tmp.replace(d / "model.safetensors")


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
            kernel_backend="cpu",
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
    return h.float(), F.linear(h, model.lm_head.weight).float()


@one_torch_thread
def train_mtp(
    model_dir: str | Path,
    steps: int = 200,
    num_prompts: int = 128,
    prompt_len: int = 16,
    new_tokens: int = 64,
    lr: Optional[float] = None,
    seed: int = 0,
    batch: int = 16,
    chain: bool = False,
    hard_weight: Optional[float] = None,
) -> dict:
    """Train the checkpoint's MTP layer in place (model.safetensors rewritten) on the model's own
    greedy continuations of corpus prompts; returns a report (steps, seconds, held-out agreement
    of the block's top-1 with the target's next-next token before and after).

    The block's decoder layer starts from a copy of the main model's last layer (same shapes;
    a better start than random weights when the main model was trained). With `chain` it also
    learns the draft chain's second step, which reads the block's own output hidden state (off
    by default: not shown to help; see docs/speculative-decoding.md). `lr` and `hard_weight`
    default to the family's recipe (`kit.MTP_LR`, `kit.MTP_HARD_WEIGHT`): `hard_weight` adds
    that much cross-entropy against the target's top-1 (the greedy continuation's token, what
    a greedy verify accepts) to the soft loss; on V4 it lifts the held-out agreement from 41%
    to 53% (docs/speculative-decoding.md)."""
    from safetensors.torch import load_file

    kit = family_kit(model_dir, "--train-mtp")
    d = kit.dir
    if not kit.num_mtp:
        raise ValueError("--train-mtp needs an MTP layer (add --mtp)")
    t0 = time.monotonic()
    # Prompts from the corpus (what the benchmark sends); the held-out eighth has its own seed.
    n_held = max(1, num_prompts // 8)
    prompts = corpus_prompts(d, num_prompts - n_held, prompt_len, seed) + corpus_prompts(
        d, n_held, prompt_len, seed + 1_000_003
    )
    seqs = _greedy_continuations(d, prompts, new_tokens)
    ids = torch.tensor(seqs)  # every sequence is prompt_len + new_tokens long
    weights = load_file(str(d / "model.safetensors"))
    hidden, logits = kit.targets(weights, seqs)
    held = slice(len(seqs) - n_held, None)
    kit.seed_mtp(weights)
    mtp = kit.mtp(weights)
    lr = kit.MTP_LR if lr is None else lr
    hard_weight = kit.MTP_HARD_WEIGHT if hard_weight is None else hard_weight
    opt = torch.optim.Adam(mtp.params, lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    sl = slice(prompt_len - 1, None)  # positions whose next-next token is generated

    def example(sel):
        # Position i (i + 2 < T): inputs h_i and token i+1, target the model's distribution at i+1.
        pred, out = mtp.forward_with_hidden(ids[sel, 1:-1], hidden[sel, :-2])
        pairs = [(pred, logits[sel, 1:-1])]
        if chain:
            # The chain's next draft: position i+1 reads the block's own output at i (not the
            # target's hidden state) and token i+2; target the distribution at i+2.
            pred2, _ = mtp.forward_with_hidden(ids[sel, 2:-1], out[:, :-1])
            pairs.append((pred2, logits[sel, 2:-1]))
        return pairs

    def agreement(sel) -> list[float]:
        with torch.no_grad():
            pairs = example(sel)
        return [round(float((p[:, sl].argmax(-1) == t[:, sl].argmax(-1)).float().mean()), 4) for p, t in pairs]

    before = agreement(held)
    g = torch.Generator().manual_seed(seed)
    n_train = len(seqs) - n_held
    losses = []
    for step in range(steps):
        pick = torch.randint(0, n_train, (min(batch, n_train),), generator=g)
        # KL(target || block) up to the target's entropy: cross-entropy on its soft distribution.
        pairs = example(pick)
        loss = sum(-(F.softmax(t, -1) * F.log_softmax(p, -1)).sum(-1).mean() for p, t in pairs)
        if hard_weight:  # the target's top-1: what greedy verification keeps
            loss = loss + hard_weight * sum(F.cross_entropy(p.flatten(0, 1), t.argmax(-1).flatten()) for p, t in pairs)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % 50 == 0:
            log.info("train-mtp step %d loss %.3f", step, losses[-1])
    if not math.isfinite(loss.item()):
        raise RuntimeError(f"--train-mtp diverged at loss {loss.item()}")
    after = agreement(held)
    _write_back(weights, mtp.w)
    kit.sync_copies(weights)  # what the block was trained with
    _save(d, weights)
    return {
        "steps": steps,
        "lr": lr,
        "hard_weight": hard_weight,
        "seconds": round(time.monotonic() - t0, 1),
        "sequences": len(seqs),
        "held_out_sequences": n_held,
        # the distillation loss (soft cross-entropy against the target's next-next distribution)
        "loss_first": round(losses[0], 3),
        "loss_last20_mean": round(sum(losses[-20:]) / len(losses[-20:]), 3),
        # Top-1 agreement with the target's next-next token on held-out continuations: the
        # first draft (from the target's hidden state) and, with `chain`, the second (from the
        # block's own, given a right first draft).
        "held_out_top1_agreement_before": before[0],
        "held_out_top1_agreement_after": after[0],
        **({"held_out_chained_agreement_after": after[1]} if chain else {}),
    }
