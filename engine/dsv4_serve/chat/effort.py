"""`reasoning_effort` as each checkpoint's chat format has it: the tiers a format declares, the
tier each requested effort lands on, and the prompt that tier adds. Pure functions.

An effort is one of OpenAI's values (`none`, `minimal`, `low`, `medium`, `high`, `xhigh`) or
DeepSeek's `max`; anything else is a 400 before this runs (protocol.py). `none` turns thinking
off everywhere. The rest land on a tier of the checkpoint's profile:

- `v4` (DeepSeek-V4's current encoder, the 0731 refresh: it declares `low`, `high` and `max`,
  default `low`): `minimal`/`low` -> low (no prompt), `medium`/`high` -> high ("Absolute
  maximum" prompt), `xhigh`/`max` -> max ("Beyond maximum" prompt). OpenAI's default tier
  (medium) lands on DeepSeek's documented default (high), as vLLM folds it.
- `v4_preview` (V4's first encoder: only `max` has a prompt, the text the 0731 refresh gave to
  `high`): `minimal` .. `high` -> high (no prompt), `xhigh`/`max` -> max ("Absolute maximum").
- `thinking` (V3.1 and V3.2: their encoders have thinking on or off and no effort): every effort
  but `none` is thinking on.
- None (a Jinja template): the effort is the template's variable, as transformers passes it.

Which V4 profile a checkpoint has is read from what it ships (`profile_declared`): SGLang's
config key `dsv4_reasoning_effort_profile` (`official` / `preview`) wins; else its bundled
`encoding/encoding_dsv4.py` (a table of effort prompts is the 0731 encoder, a single max prompt
the preview one); else `v4`, the encoder DeepSeek ships today.
"""

from __future__ import annotations

import os
from typing import Optional

from dsv4_serve.chat.pieces import RenderError

EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")

_ABSOLUTE_MAXIMUM = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve "
    "the root cause, rigorously stress-testing your logic against all potential paths, edge cases, and "
    "adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)
_BEYOND_MAXIMUM = (
    "Reasoning Effort: Beyond maximum — exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively "
    "decompose the problem into its most fundamental components, trace every causal chain to its root, and "
    "resolve the underlying cause rather than any surface symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple angles and are "
    "certain that no assumption remains unchecked and no error remains undiscovered.\n\n"
)

# profile -> (requested effort -> tier, tier -> the prompt it adds, the tier when none is asked)
PROFILES: dict[str, tuple[dict[str, str], dict[str, str], str]] = {
    "v4": (
        {"minimal": "low", "low": "low", "medium": "high", "high": "high", "xhigh": "max", "max": "max"},
        {"low": "", "high": _ABSOLUTE_MAXIMUM, "max": _BEYOND_MAXIMUM},
        "low",
    ),
    "v4_preview": (
        {"minimal": "high", "low": "high", "medium": "high", "high": "high", "xhigh": "max", "max": "max"},
        {"high": "", "max": _ABSOLUTE_MAXIMUM},
        "high",
    ),
    "thinking": ({e: "on" for e in EFFORTS[1:]}, {"on": ""}, "on"),
}
# SGLang's names for the two V4 profiles (its config key's values)
DECLARED_NAMES = {"official": "v4", "preview": "v4_preview"}


def tier(profile: Optional[str], effort: Optional[str]) -> Optional[str]:
    """The tier `effort` lands on (None: thinking off, or a profile without tiers)."""
    if profile is None or effort == "none":
        return None
    folds, _, default = PROFILES[profile]
    if effort is not None and effort not in folds:  # the request model refuses it first; a caller may not
        raise RenderError(f"reasoning_effort {effort!r} is not one of {', '.join(EFFORTS)}")
    return default if effort is None else folds[effort]


def effort_prompt(profile: Optional[str], effort: Optional[str]) -> str:
    """The text a thinking turn starts with for `effort` ("" for none)."""
    t = tier(profile, effort)
    return "" if t is None else PROFILES[profile][1][t]


def profile_declared(model_dir: str, config: dict) -> str:
    """A V4 checkpoint's effort profile, from what it ships (see the module's docstring)."""
    declared = config.get("dsv4_reasoning_effort_profile")
    if declared is not None:
        if declared not in DECLARED_NAMES:
            raise ValueError(
                f"config.json: dsv4_reasoning_effort_profile {declared!r} is not one of {', '.join(DECLARED_NAMES)}"
            )
        return DECLARED_NAMES[declared]
    try:
        with open(os.path.join(model_dir, "encoding", "encoding_dsv4.py"), encoding="utf-8") as f:
            encoder = f.read()
    except OSError:
        return "v4"
    if "REASONING_EFFORT_PROMPTS" in encoder:
        return "v4"
    if "REASONING_EFFORT_MAX" in encoder:
        return "v4_preview"
    return "v4"
