"""Turns a scheduled step into tensors, runs the model and samples one token per request that
reached its last known token."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

import torch

from dsv4_engine.kv_cache import KVPool
from dsv4_engine.models import entry_for_dir
from dsv4_engine.models.deepseek_v3 import ForwardBatch
from dsv4_engine.models.state import StateSpec
from dsv4_engine.sampling import Sampled, sample
from dsv4_engine.scheduler import ScheduledSeq
from dsv4_engine.weights import load_weights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_kernel_backend(device: torch.device) -> str:
    return "triton" if device.type == "cuda" else "torch"


def get_ops(backend: str):
    from dsv4_kernels import get_ops as kernels_get_ops

    return kernels_get_ops(backend)


class ModelRunner:
    def __init__(self, model_dir: str | Path, dtype: str = "float32", device: Optional[str] = None,
                 kernel_backend: Optional[str] = None, tp=None):
        entry = entry_for_dir(model_dir)
        self.model_type = entry.model_type
        self.cfg = entry.config_class().from_dir(model_dir)
        model_cls = entry.model_class()
        self.state_specs: list[StateSpec] = model_cls.state_specs(self.cfg)
        self.device = torch.device(device) if device else default_device()
        self.dtype = DTYPES[dtype]
        self.kernel_backend = kernel_backend or default_kernel_backend(self.device)
        if tp is None:
            self.model = model_cls(self.cfg, load_weights(model_dir), get_ops(self.kernel_backend), self.dtype, self.device)
        else:  # one rank of --tp-size N: its own slice of the weights only (dsv4_engine.parallel)
            from dsv4_engine.parallel.sharded import build_sharded

            self.model = build_sharded(model_cls, self.model_type, self.cfg, model_dir, get_ops(self.kernel_backend),
                                       self.dtype, self.device, tp)
        # DeepSeek-V4 (the models with slot states) batches attention over requests only in an
        # all-decode step and runs each request alone otherwise, so a mixed step runs as two
        # forwards, decodes then prefills (+27% tok/s at 32 clients on v4-tiny, CPU).
        self.decode_apart = any(not spec.paged for spec in self.state_specs)

    def build_batch(self, batch: list[ScheduledSeq], page_size: int) -> ForwardBatch:
        ids, pos, slots, seq_lens, ext, last = [], [], [], [], [], []
        max_pages = max(len(b.seq.pages) for b in batch)
        table = torch.zeros(len(batch), max_pages, dtype=torch.int32)
        for i, b in enumerate(batch):
            s, start = b.seq, b.seq.num_computed
            end = start + b.num_new
            ids.extend(s.token_at(j) for j in range(start, end))
            pos.extend(range(start, end))
            slots.extend(s.pages[j // page_size] * page_size + j % page_size for j in range(start, end))
            table[i, : len(s.pages)] = torch.tensor(s.pages, dtype=torch.int32)
            seq_lens.append(end)
            ext.append(b.num_new)
            last.append(len(ids) - 1)
        dev = self.device
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(pos, dtype=torch.int64, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_table=table.to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            extend_lens=torch.tensor(ext, dtype=torch.int32, device=dev),
            logits_indices=torch.tensor(last, dtype=torch.int64, device=dev),
            all_decode=all(n == 1 for n in ext),
            slot_ids=(torch.tensor([b.seq.slot for b in batch], dtype=torch.int64, device=dev)
                      if all(b.seq.slot is not None for b in batch) else None),
            page_size=page_size,
        )

    def forward(self, batch: list[ScheduledSeq], pool: KVPool) -> torch.Tensor:
        """Logits of each request's last new token, [len(batch), vocab], in batch order."""
        decodes = [i for i, b in enumerate(batch) if b.num_new == 1]
        if not self.decode_apart or not decodes or len(decodes) == len(batch):
            return self.model.forward(self.build_batch(batch, pool.page_size), pool.all_states)
        others = [i for i, b in enumerate(batch) if b.num_new != 1]
        out: list[torch.Tensor] = [None] * len(batch)  # type: ignore[list-item]
        for rows in (decodes, others):
            logits = self.model.forward(self.build_batch([batch[i] for i in rows], pool.page_size), pool.all_states)
            for j, i in enumerate(rows):
                out[i] = logits[j]
        return torch.stack(out)

    def step(self, batch: list[ScheduledSeq], pool: KVPool) -> list[Union[Sampled, Exception, None]]:
        """Forward the step (a forward failure raises: it fails the batch). For each request that
        samples: a Sampled, or the exception its row raised (it fails that request alone);
        None for the others."""
        logits = self.forward(batch, pool)
        rows = [i for i, b in enumerate(batch) if b.samples]
        results: list[Union[Sampled, Exception, None]] = [None] * len(batch)
        if rows:
            picked = sample(logits[rows], [batch[i].seq.params for i in rows], [batch[i].seq.generator for i in rows])
            for i, r in zip(rows, picked):
                results[i] = r
        return results
