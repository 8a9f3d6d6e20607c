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
    out = {
        k: length_strings_safe(v)
        if isinstance(v, (dict, list)) and k not in ("enum", "const", "default", "examples")
        else v
        for k, v in schema.items()
    }
    if (
        out.get("type") == "string"
        and ("minLength" in out or "maxLength" in out)
        and not any(k in out for k in _STRING_SHAPERS)
    ):
        lo, hi = int(out.pop("minLength", 0)), out.pop("maxLength", None)
        out["pattern"] = f"^{_PLAIN_CHAR}{{{lo},{'' if hi is None else int(hi)}}}$"
    return out


# A JSON string's raw text, one character or escape at a time (a pattern applies to the text
# between the quotes as written, escapes included).
_ESCAPE = r'\\["\\/bfnrt]|\\u[0-9a-fA-F]{4}'


def strings_without(schema, forbidden: str):
    """`schema` with every string schema that a pattern, format, enum or const does not already
    shape limited to text without the characters of `forbidden` (length bounds kept as in
    length_strings_safe; unbounded strings keep their escapes). For tool-call arguments: a
    DeepSeek marker (`<｜tool▁call▁end｜>`) inside an argument string would end the call for the
    parser while the grammar still reads a string; its full-width bar never needs to be raw there."""
    if not forbidden:
        return length_strings_safe(schema)
    if isinstance(schema, list):
        return [strings_without(s, forbidden) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {
        k: strings_without(v, forbidden)
        if isinstance(v, (dict, list)) and k not in ("enum", "const", "default", "examples")
        else v
        for k, v in schema.items()
    }
    if out.get("type") == "string" and not any(k in out for k in _STRING_SHAPERS):
        plain = _PLAIN_CHAR[:-1] + forbidden + "]"
        if "minLength" in out or "maxLength" in out:
            lo, hi = int(out.pop("minLength", 0)), out.pop("maxLength", None)
            out["pattern"] = f"^{plain}{{{lo},{'' if hi is None else int(hi)}}}$"
        else:
            out["pattern"] = f"^({plain}|{_ESCAPE})*$"
    return out
