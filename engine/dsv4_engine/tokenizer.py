"""Text <-> token ids for the engine, at runtime, with the `tokenizers` library only.

`Tokenizer` loads any Hugging Face fast-tokenizer folder (`tokenizer.json` + `tokenizer_config.json`);
our own checkpoints carry a byte-level BPE and the DeepSeek chat format below, which is rendered in
plain Python. A foreign chat template is rendered with jinja2, as transformers would.
`IncrementalDetokenizer` turns a stream of ids into text deltas that never end inside a character.
"""

from __future__ import annotations

import json
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

import tokenizers

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
USER_TOKEN = "<｜User｜>"
ASSISTANT_TOKEN = "<｜Assistant｜>"
# Order fixes the ids of our checkpoints: bos 0, eos 1, as in DeepSeek-V3.
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, USER_TOKEN, ASSISTANT_TOKEN)

# The chat format of our checkpoints (DeepSeek style): bos, the system prompt(s), then
# <｜User｜>text and <｜Assistant｜>text<｜end▁of▁sentence｜> turns. `render_chat` is its Python twin;
# a test renders both through transformers and compares.
CHAT_TEMPLATE = (
    "{%- macro text_of(content) -%}"
    "{%- if content is none -%}"
    "{%- elif content is string -%}{{ content }}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set ns = namespace(system='') -%}"
    "{%- for message in messages -%}{%- if message['role'] == 'system' -%}"
    "{%- set ns.system = ns.system ~ ('\\n\\n' if ns.system else '') ~ text_of(message['content']) -%}"
    "{%- endif -%}{%- endfor -%}"
    "{{- bos_token ~ ns.system -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}"
    "{{- '<｜User｜>' ~ text_of(message['content']) -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- '<｜Assistant｜>' ~ text_of(message['content']) ~ eos_token -}}"
    "{%- elif message['role'] != 'system' -%}"
    "{{- raise_exception('unsupported chat role: ' ~ message['role']) -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<｜Assistant｜>' -}}{%- endif -%}"
)


def _text_of(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content if isinstance(part, dict) and part.get("type") == "text")


def render_chat(
    messages: Sequence[dict], add_generation_prompt: bool = True, bos_token: str = BOS_TOKEN, eos_token: str = EOS_TOKEN
) -> str:
    """CHAT_TEMPLATE in Python: the same string, without a template engine."""
    system = ""
    for m in messages:
        if m["role"] == "system":
            if system:
                system += "\n\n"
            system += _text_of(m.get("content"))
    out = [bos_token, system]
    for m in messages:
        role = m["role"]
        if role == "user":
            out += [USER_TOKEN, _text_of(m.get("content"))]
        elif role == "assistant":
            out += [ASSISTANT_TOKEN, _text_of(m.get("content")), eos_token]
        elif role != "system":
            raise ValueError(f"unsupported chat role: {role}")
    if add_generation_prompt:
        out.append(ASSISTANT_TOKEN)
    return "".join(out)


def _token_content(tok: Any) -> Optional[str]:
    """tokenizer_config.json writes special tokens as a string or as an AddedToken dict."""
    if isinstance(tok, dict):
        return tok.get("content")
    return tok if isinstance(tok, str) else None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _load_chat_template(folder: Path, tok_config: dict) -> Optional[str]:
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    if template:
        return template
    # transformers >= 4.43 may save the template next to the config instead of inside it.
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    return _read_json(folder / "chat_template.json").get("chat_template")


class Tokenizer:
    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        bos_token: Optional[str],
        eos_tokens: Iterable[str],
        chat_template: Optional[str] = None,
        add_bos: bool = True,
        extra_eos_ids: Iterable[int] = (),
    ):
        self.backend = backend
        self.bos_token = bos_token
        self.bos_id: Optional[int] = backend.token_to_id(bos_token) if bos_token else None
        self.eos_token: Optional[str] = None
        eos_ids: list[int] = []
        for t in eos_tokens:
            i = backend.token_to_id(t)
            if i is not None:
                self.eos_token = self.eos_token or t
                eos_ids.append(i)
        for i in extra_eos_ids:
            if i not in eos_ids:
                eos_ids.append(i)
        self.eos_ids: list[int] = eos_ids
        self.chat_template = chat_template
        self.add_bos = add_bos and self.bos_id is not None
        self._added: Optional[list[str]] = None
        self._added_re = None
        self._plain: Optional[tokenizers.Tokenizer] = None

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        """Load a checkpoint's tokenizer: ours, or any fast tokenizer saved by transformers."""
        folder = Path(path)
        if not (folder / "tokenizer.json").is_file():
            raise FileNotFoundError(f"no tokenizer.json in {folder}")
        backend = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        tok_config = _read_json(folder / "tokenizer_config.json")
        gen_config = _read_json(folder / "generation_config.json")
        model_config = _read_json(folder / "config.json")

        bos = _token_content(tok_config.get("bos_token"))
        eos = _token_content(tok_config.get("eos_token"))
        if bos is None:  # no tokenizer_config: fall back to the model's ids
            bos_id = (_ids(gen_config.get("bos_token_id")) or _ids(model_config.get("bos_token_id")) or [None])[0]
            bos = backend.id_to_token(bos_id) if bos_id is not None else None
        # generation_config may list several end ids (e.g. end of turn); all of them stop generation.
        extra_eos = _ids(gen_config.get("eos_token_id")) or _ids(model_config.get("eos_token_id"))
        return cls(
            backend,
            bos_token=bos,
            eos_tokens=[eos] if eos else [],
            chat_template=_load_chat_template(folder, tok_config),
            add_bos=tok_config.get("add_bos_token", True) is not False,
            extra_eos_ids=extra_eos,
        )

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Special-token strings inside `text` become their ids; bos is prepended when asked for and
        the tokenizer uses one (a rendered chat prompt already starts with it: pass add_bos=False)."""
        # encode_batch releases the GIL while it works (encode does not): a long prompt tokenised
        # on a worker thread then leaves the server's event loop free.
        ids = self.backend.encode_batch([text], add_special_tokens=False)[0].ids
        if add_bos and self.add_bos:
            return [self.bos_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text for a chat; encode it with add_bos=False."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        if self.chat_template == CHAT_TEMPLATE:
            return render_chat(messages, add_generation_prompt, self.bos_token or "", self.eos_token or "")
        return self._render_jinja(messages, add_generation_prompt)

    def _render_jinja(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return render_jinja_text(
            self.chat_template, messages, add_generation_prompt, self.bos_token or "", self.eos_token or ""
        )

    @property
    def added_tokens(self) -> list[str]:
        """Every added (special or not) token's text, longest first: what a rendered prompt may spell."""
        if self._added is None:
            self._added = sorted(
                (t.content for t in self.backend.get_added_tokens_decoder().values()), key=len, reverse=True
            )
        return self._added

    def encode_plain(self, text: str) -> list[int]:
        """`text` as plain text: a special token's spelling inside it is encoded character by
        character, never as the special token (client-supplied text must not forge turns)."""
        if self._plain is None:
            spec = json.loads(self.backend.to_str())
            spec["added_tokens"] = []
            self._plain = tokenizers.Tokenizer.from_str(json.dumps(spec))
        return self._plain.encode_batch([text], add_special_tokens=False)[0].ids if text else []

    def encode_pieces(self, pieces: Iterable[tuple[str, bool]]) -> list[int]:
        """A rendered chat prompt -> ids. Trusted pieces (the renderer's own text) may spell added
        tokens, which become their ids; everything else (and untrusted pieces) is plain text. Runs
        of plain text are encoded together, so ids equal encoding the whole prompt the usual way
        whenever the client's text spells no special token."""
        import re

        if self._added_re is None:
            toks = self.added_tokens
            self._added_re = re.compile("|".join(re.escape(t) for t in toks)) if toks else None
        ids: list[int] = []
        run: list[str] = []
        for text, trusted in pieces:
            if not trusted or self._added_re is None:
                run.append(text)
                continue
            pos = 0
            for m in self._added_re.finditer(text):
                run.append(text[pos : m.start()])
                ids += self.encode_plain("".join(run))
                run = []
                ids.append(self.backend.token_to_id(m.group(0)))
                pos = m.end()
            run.append(text[pos:])
        ids += self.encode_plain("".join(run))
        return ids


_JINJA_CACHE: dict[str, Any] = {}
# What the `tojson` filter does to its output during one render (the chat renderer's: client
# strings marked as untrusted are re-marked with their JSON-escaped text).
_TOJSON_HOOK: ContextVar[Optional[Callable[[str], str]]] = ContextVar("tojson_hook", default=None)


def _tojson(x: Any, indent: Optional[int] = None) -> str:
    text = json.dumps(x, ensure_ascii=False, indent=indent)
    hook = _TOJSON_HOOK.get()
    return hook(text) if hook is not None else text


def render_jinja_text(
    template: str,
    messages: list[dict],
    add_generation_prompt: bool,
    bos_token: str,
    eos_token: str,
    variables: Optional[dict] = None,
    tojson_hook: Optional[Callable[[str], str]] = None,
) -> str:
    """Render a chat template in the environment transformers uses for them: sandboxed, trimmed
    blocks, loop controls, and a raise_exception helper that templates call on bad input.
    `tojson_hook`: applied to every `tojson` output of this render."""
    compiled = _JINJA_CACHE.get(template)
    if compiled is None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise ValueError(message)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = raise_exception
        compiled = _JINJA_CACHE[template] = env.from_string(template)
    token = _TOJSON_HOOK.set(tojson_hook)
    try:
        return compiled.render(
            **(variables or {}),
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
        )
    finally:
        _TOJSON_HOOK.reset(token)


class IncrementalDetokenizer:
    """Feeds generated ids one at a time and returns the new text each one completes.

    Each step decodes a short window of ids twice — without and with the newest id — and emits the
    difference. While the window's text ends in U+FFFD (a multi-byte character still missing bytes)
    nothing is emitted and the window grows, so a delta is always whole characters; `flush()` gives
    whatever is left at the end. Decoding windows rather than single ids keeps tokenizers whose
    decoders look at neighbours (e.g. leading-space rules) exact. The joined deltas equal
    `tokenizer.decode(all generated ids)`.
    """

    _PROMPT_CONTEXT = 4  # prompt ids kept as context for the first window

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_ids[-self._PROMPT_CONTEXT :])
        if "\ufffd" in self._decode(context):  # a prompt cut inside a character is no useful context
            context = []
        self._ids: list[int] = context
        self._prefix = 0  # window start: first id of the already emitted text still used as context
        self._read = len(context)  # window split: ids before it have been emitted
        self.text = ""  # everything emitted so far

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        delta = after[len(before) :]
        self._prefix, self._read = self._read, len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """The held-back text (an incomplete character decodes to U+FFFD, as a full decode would)."""
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        delta = after[len(before) :]
        self._prefix = self._read = len(self._ids)
        self.text += delta
        return delta
