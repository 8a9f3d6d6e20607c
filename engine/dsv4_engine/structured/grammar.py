"""Compiling structured-output specs into token-level grammars (xgrammar), once per spec.

`GrammarCompiler` knows the model's vocabulary (every token as the bytes it decodes to, the
stop tokens) and keeps the most recently used compiled grammars (an LRU keyed by the spec), so
the many requests of an agent loop that share a schema compile it once. A spec it cannot
compile raises `GrammarError` with the grammar engine's own words: the engine turns that into
a 400 before the request is scheduled.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Iterable, Optional

import xgrammar as xgr

from dsv4_engine.structured.schema import length_strings_safe
from dsv4_engine.structured.spec import StructuredSpec
from dsv4_wire import chat_tokens as T
from dsv4_engine.structured.tool_calls import is_auto, spec_grammar, spec_structural_tag

DEFAULT_CACHE_SIZE = 256  # compiled grammars kept (a JSON-schema grammar on a 128k vocab is ~100s of KiB)


class GrammarError(ValueError):
    """The spec is not a grammar this engine can serve (the message names the problem)."""


def tokenizer_info(backend, vocab_size: int, stop_ids: Iterable[int]) -> xgr.TokenizerInfo:
    """The grammar engine's view of a `tokenizers.Tokenizer`: each id's token text in the
    tokenizer's own encoding (byte-level, byte-fallback or raw), `vocab_size` ids in all (the
    model's, which may exceed the tokenizer's: ids without a token are never allowed). Special
    tokens are given as empty strings, which xgrammar never allows inside a grammar; the stop
    ids are the only special tokens it lets through, and only where the grammar may end.
    DeepSeek's chat markers (`<think>`, the tool-call tokens, `｜DSML｜`) are text to the
    grammars even where a tokenizer marks them special: the tool-call and reasoning grammars
    are made of them, and would otherwise admit no call at all."""
    special = {t.content for t in backend.get_added_tokens_decoder().values() if t.special} - set(T.CHAT_ADDED_TOKENS)
    vocab: list[str] = []
    for i in range(vocab_size):
        tok = backend.id_to_token(i)
        vocab.append("" if tok is None or tok in special else tok)
    return xgr.TokenizerInfo(
        vocab, _vocab_type(backend), vocab_size=vocab_size, stop_token_ids=sorted(set(stop_ids)), add_prefix_space=False
    )


def _vocab_type(backend) -> xgr.VocabType:
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders", []) or []}
    if "ByteLevel" in kinds:
        return xgr.VocabType.BYTE_LEVEL
    if "ByteFallback" in kinds:
        return xgr.VocabType.BYTE_FALLBACK
    return xgr.VocabType.RAW


def choice_ebnf(options: list[str]) -> str:
    """A grammar whose language is exactly `options` (string literals in JSON's escaping,
    which xgrammar's EBNF reads)."""
    return "root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options)


class GrammarCompiler:
    def __init__(self, info: xgr.TokenizerInfo, cache_size: int = DEFAULT_CACHE_SIZE, threads: int = 1):
        self.info = info
        self.vocab_size = info.vocab_size
        # xgrammar's own cache is off: ours is keyed by the spec and bounded by count.
        self._compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self._cache: "OrderedDict[StructuredSpec, xgr.CompiledGrammar]" = OrderedDict()
        self.cache_size = cache_size
        self.hits = self.misses = 0
        self._lock = threading.Lock()  # the cache: read on the engine thread, filled on the compile thread

    def cached(self, spec: StructuredSpec) -> Optional[xgr.CompiledGrammar]:
        """The compiled grammar of a spec compiled before, else None (no compiling: safe on the
        engine thread while another thread compiles)."""
        with self._lock:
            got = self._cache.get(spec)
            if got is not None:
                self._cache.move_to_end(spec)
                self.hits += 1
            return got

    def compile(self, spec: StructuredSpec) -> xgr.CompiledGrammar:
        got = self.cached(spec)
        if got is not None:
            return got
        self.misses += 1
        try:
            spec.check()
            compiled = self._compile(spec)
        except GrammarError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError/ValueError/its own types, with the reason
            raise GrammarError(f"{spec.kind}: {_first_line(e)}") from None
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredSpec) -> xgr.CompiledGrammar:
        c = self._compiler
        if spec.kind == "json_object":
            # Any JSON object (OpenAI's json_object is an object, not any JSON value), compact.
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.kind == "json_schema":
            # Compact separators: a model cannot pad the output with whitespace for ever
            # (any_whitespace lets a weak model loop on spaces until max_tokens).
            schema = json.dumps(length_strings_safe(json.loads(spec.value)))
            return c.compile_json_schema(schema, any_whitespace=False, strict_mode=True)
        if spec.kind == "regex":
            return c.compile_regex(spec.value)
        if spec.kind == "choice":
            return c.compile_grammar(choice_ebnf(json.loads(spec.value)))
        if spec.kind == "ebnf":
            return c.compile_grammar(spec.value)
        if spec.kind == "structural_tag":
            return c.compile_structural_tag(spec.value)
        if spec.kind == "tool_calls":
            if is_auto(spec.value):  # free text, then (maybe) one well-formed call block
                return c.compile_structural_tag(spec_structural_tag(spec.value))
            return c.compile_grammar(spec_grammar(spec.value))
        raise GrammarError(f"unknown structured output kind {spec.kind!r}")


def _first_line(e: BaseException) -> str:
    """The reason without xgrammar's log prefix ("[12:00:00] /project/cpp/file.cc:94: ")."""
    text = str(e).strip() or type(e).__name__
    line = text.splitlines()[0]
    return re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", line)[:500]


class Matcher:
    """One request's position in its grammar: advanced with every token the request accepts
    (`sync` takes the tokens it has not seen yet, so a matcher rebuilt after preemption or on a PD
    decode engine accepts each token exactly once)."""

    __slots__ = ("m", "accepted")

    def __init__(self, compiled: xgr.CompiledGrammar):
        self.m = xgr.GrammarMatcher(compiled)
        self.accepted = 0  # output tokens taken so far

    def sync(self, output_ids: list[int]) -> None:
        """Accept output_ids[accepted:]; raise GrammarError if one is outside the grammar."""
        for tok in output_ids[self.accepted :]:
            if self.m.is_terminated():
                raise GrammarError(f"token {tok} came after the grammar was complete")
            if not self.m.accept_token(tok):
                raise GrammarError(f"token {tok} is not allowed by the grammar here")
            self.accepted += 1

    @property
    def terminated(self) -> bool:
        """The grammar is complete and admits nothing more (a stop token was accepted, or the
        output can only end)."""
        return self.m.is_terminated()

    def fill(self, bitmask, row: int) -> None:
        self.m.fill_next_token_bitmask(bitmask, row)


def new_compiler(
    backend, vocab_size: int, stop_ids: Iterable[int], cache_size: Optional[int] = None
) -> GrammarCompiler:
    return GrammarCompiler(tokenizer_info(backend, vocab_size, stop_ids), cache_size or DEFAULT_CACHE_SIZE)
