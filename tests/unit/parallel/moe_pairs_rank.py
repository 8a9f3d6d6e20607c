"""One rank of the expert-parallel pair count (tests/unit/parallel/test_tp_moe_pairs.py), or
the whole model when run with size 1: runs one prefill step of the tiny model and saves its
logits and how many (token, expert) pairs its expert calls computed.

`python moe_pairs_rank.py MODEL_DIR RANK SIZE PORT OUT`"""

from __future__ import annotations

import sys

import torch


def prefill_and_count(runner) -> tuple[torch.Tensor, int, int]:
    """Logits of one two-request prefill, the pairs computed (ids naming one of this rank's
    experts: every expert implementation skips the others, see dsv4_kernels.reference) and the
    pairs routed in all."""
    from dsv4_engine.kv_cache import KVPool
    from dsv4_engine.sampling_params import SamplingParams
    from dsv4_engine.scheduler import ScheduledSeq
    from dsv4_engine.sequence import Sequence

    from dsv4_kernels import cpu_moe

    model = runner.model
    counted = {"computed": 0, "routed": 0}
    experts, native = model.moe_experts, cpu_moe.experts

    def count(w13, ids) -> None:
        counted["computed"] += int(((ids >= 0) & (ids < w13.shape[0])).sum())
        counted["routed"] += ids.numel()

    def counting(x, w13, w2, weights, ids):
        count(w13, ids)
        return experts(x, w13, w2, weights, ids)

    def counting_native(x, w13, w2, weights, ids, *rest, **kw):  # a few tokens on the CPU: one C call
        if w13 is not None:
            count(w13, ids)
        return native(x, w13, w2, weights, ids, *rest, **kw)

    model.moe_experts = counting
    cpu_moe.experts = counting_native
    pool = KVPool(runner.state_specs, 16, 8, runner.dtype, runner.device)
    batch = []
    for i, (prompt, pages) in enumerate((([5 + j for j in range(13)], [0, 1]), ([40, 41, 42, 43, 44], [2]))):
        s = Sequence(f"r{i}", prompt, SamplingParams(max_tokens=4, temperature=0))
        s.pages = pages
        batch.append(ScheduledSeq(s, len(prompt)))
    try:
        logits = model.forward(runner.build_batch(batch, pool.page_size), pool.all_states)
    finally:
        cpu_moe.experts = native  # the test process runs this too: leave the module as it was
    return logits, counted["computed"], counted["routed"]


def main() -> None:
    model_dir, r, size, port, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    torch.set_num_threads(1)
    from dsv4_engine.model_runner import ModelRunner

    if size == 1:
        runner = ModelRunner(model_dir, device="cpu", kernel_backend="cpu")
    else:
        from dsv4_engine.parallel.group import join
        from dsv4_engine.parallel.plan import Shard

        runner = ModelRunner(model_dir, device="cpu", kernel_backend="cpu", tp=join(Shard(r, size), port, "cpu"))
    logits, computed, routed = prefill_and_count(runner)
    torch.save({"logits": logits, "computed": computed, "routed": routed}, out)
    if size > 1:
        import torch.distributed as dist

        dist.destroy_process_group()


if __name__ == "__main__":
    main()
