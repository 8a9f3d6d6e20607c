"""The engine's speculator from its flags, or a one-line refusal (ValueError)."""

from __future__ import annotations

from typing import Optional

from dsv4_engine.kv_quant import pool_kv_dtype, with_kv_cache_dtype
from dsv4_engine.spec_decode.mtp_layer import mtp_state_spec, num_mtp_layers
from dsv4_engine.spec_decode.options import engine_refusal, normalize_algorithm
from dsv4_engine.spec_decode.speculator import MTPSpeculator


def speculation_refusal(args) -> Optional[str]:
    """Why the engine `args` describe cannot speculate as asked, in one line, or None; reads
    config.json only (before any weight)."""
    try:
        algorithm = normalize_algorithm(args.speculative_algorithm)
    except ValueError as e:
        return str(e)
    if algorithm is None:
        return None
    from dsv4_engine.models import entry_for_dir

    entry = entry_for_dir(args.model)
    refusal = engine_refusal(
        algorithm, args.speculative_num_steps, entry.model_type, num_mtp_layers(args.model), args.role, args.tp_size
    )
    if refusal is None and entry.model_type == "deepseek_v4":
        from dsv4_engine.spec_decode.mtp_v4 import min_ring

        ring = min_ring(entry.model_class().state_specs(entry.config_class().from_dir(args.model)))
        if args.speculative_num_steps + 1 > ring:
            return (
                f"--speculative-num-steps {args.speculative_num_steps}: a step's drafts and last token must fit "
                f"the model's smallest ring ({ring} positions: window or compressor stage); use at most {ring - 1}"
            )
    return refusal


def build_speculator(args, runner) -> MTPSpeculator:
    refusal = speculation_refusal(args)
    if refusal:
        raise ValueError(refusal)
    return make_speculator(runner, args.model, args.speculative_num_steps)


def make_speculator(runner, model_dir: str, num_steps: int) -> MTPSpeculator:
    """The speculator over `runner`'s model, its MTP layer loaded (this rank's shard of it at
    --tp-size N: the other ranks build one too, and run its forwards as rank 0 sends them)."""
    spec = MTPSpeculator(runner, model_dir, num_steps)
    if runner.model_type == "deepseek_v4":
        from dsv4_engine.spec_decode.mtp_v4 import v4_mtp_state_spec

        specs = [v4_mtp_state_spec(runner.cfg)]
    else:
        specs = [mtp_state_spec(runner.cfg)]
    # fp8kv: the MTP block's KV is stored as the model's is (its attention reads and writes it
    # through kv_quant, and V4's catch-up copies its ring rows into the main window ring)
    spec.state_specs = with_kv_cache_dtype(specs, pool_kv_dtype(runner.state_specs))
    return spec
