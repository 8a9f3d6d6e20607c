"""`--speculative-algorithm` and `--speculative-num-steps`: spellings, limits and refusals at start.

Pure (no torch): the CLI and the HTTP process check flags with it. Every request a plain engine
serves, a speculating one serves too (structured outputs, penalties, logit_bias, min_tokens:
verification processes each position's logits from the tokens before it).
"""

from __future__ import annotations

from typing import Optional

# Our name, SGLang's (EAGLE / NEXTN: both run the checkpoint's MTP layer for DeepSeek) and
# vLLM's ("mtp", "deepseek_mtp"), case-insensitive.
ALGORITHM_ALIASES = {"mtp": "mtp", "eagle": "mtp", "nextn": "mtp", "deepseek_mtp": "mtp"}
MAX_NUM_STEPS = 8


def normalize_algorithm(name: Optional[str]) -> Optional[str]:
    """'mtp' for any accepted spelling, None for none; ValueError (one line) for an unknown one."""
    if name is None or name == "" or name.lower() == "none":
        return None
    canon = ALGORITHM_ALIASES.get(name.lower())
    if canon is None:
        raise ValueError(
            f"--speculative-algorithm {name!r} is not supported; use mtp "
            f"(aliases: {', '.join(sorted(set(ALGORITHM_ALIASES) - {'mtp'}))})"
        )
    return canon


def engine_refusal(
    algorithm: Optional[str], num_steps: int, model_type: str, num_mtp_layers: int, role: str, tp_size: int
) -> Optional[str]:
    """Why an engine cannot speculate as asked, in one line, or None. Everything not built yet is
    refused here rather than run without speculation."""
    if algorithm is None:
        return None
    if not 1 <= num_steps <= MAX_NUM_STEPS:
        return f"--speculative-num-steps must be between 1 and {MAX_NUM_STEPS}, not {num_steps}"
    if model_type not in ("deepseek_v3", "deepseek_v4"):
        return f"--speculative-algorithm mtp runs DeepSeek-V3's and V4's MTP layer; {model_type} is not supported"
    if num_mtp_layers < 1:
        return (
            "--speculative-algorithm mtp needs a checkpoint with an MTP layer (config.json "
            "num_nextn_predict_layers >= 1; `dsv4 model init --mtp` writes one)"
        )
    return None
