"""Rewrites of JSON Schemas before xgrammar compiles them (plain Python, no grammar engine)."""

from __future__ import annotations

# What a length-bounded JSON string may hold unescaped (JSON forbids raw quotes, backslashes and
# control characters inside a string).
_PLAIN_CHAR = r'[^"\\\x00-\x1f]'
_STRING_SHAPERS = ("pattern", "format", "enum", "const")


def length_strings_safe(schema):
    """`schema` with every string schema bounded only by minLength/maxLength rewritten as the
    same bounds on a pattern of plain characters. xgrammar 0.2.9 compiles such a string to
    "any character but quote, backslash, CR and LF", which lets a model write other control
    characters raw: invalid JSON (found by tests/unit/engine/test_structured_engine.py). The
    pattern form is exact and keeps the length bounds (it gives up escapes in those strings)."""
    if isinstance(schema, list):
        return [length_strings_safe(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: length_strings_safe(v) if isinstance(v, (dict, list)) and k not in ("enum", "const", "default", "examples")
           else v for k, v in schema.items()}
    if (out.get("type") == "string" and ("minLength" in out or "maxLength" in out)
            and not any(k in out for k in _STRING_SHAPERS)):
        lo, hi = int(out.pop("minLength", 0)), out.pop("maxLength", None)
        out["pattern"] = f"^{_PLAIN_CHAR}{{{lo},{'' if hi is None else int(hi)}}}$"
    return out
