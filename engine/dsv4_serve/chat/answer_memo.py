"""A chat client re-sends the model's answer as text; its KV is cached under the ids the model
generated. Tokenizing the text again does not always give those ids back (a generated token can
come back as three: two tokens into an answer, the prefix cache stops matching), so the next round
would recompute the answer. This memo remembers, per cache salt (tenant), the ids an answer was
generated as, keyed by a hash of its text; rendering a later prompt splices those ids in where an
assistant message's text is exactly such an answer.

Exactness: an answer is remembered only when the client got, as the message's content, all the
text the engine emitted for all of its ids (no reasoning or tool call was parsed out of it, and it
ended at its length or an end-of-sequence token, not at a stop string whose tokens the text
leaves out), and spliced only where
it sits between two special tokens (the chat format's turn markers), so every other piece of the
prompt encodes exactly as without the memo. A client that changed the text (one character) hashes
differently and is tokenized as today. Bounded: the oldest entries go first.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import Callable, Iterable, Optional, Sequence

Piece = tuple[str, bool]  # (text, trusted), as dsv4_serve.chat.render produces them

DEFAULT_ANSWERS = 4096


def _key(salt: Optional[str], text: str) -> tuple[str, bytes]:
    return (salt or "", hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest())


class AnswerMemo:
    def __init__(self, capacity: int = DEFAULT_ANSWERS):
        self.capacity = capacity
        self._ids: OrderedDict[tuple[str, bytes], tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()
        self.spliced = 0  # answers rendered with their generated ids

    def __len__(self) -> int:
        return len(self._ids)

    def remember(
        self,
        salt: Optional[str],
        content: str,
        ids: Sequence[int],
        emitted: str,
        eos_ids: Iterable[int] = (),
        finish: str = "length",
    ) -> bool:
        """Keep `ids` (a finished answer's generated ids) for `content` (what the client got as the
        message's content) when that content is all the text the engine emitted for those ids
        (`emitted`: no reasoning or tool call parsed out of it). A trailing end-of-sequence token
        is the chat format's own marker, which the renderer writes after the content."""
        ids = list(ids)
        eos = set(eos_ids)
        if finish != "length" and not (finish == "stop" and ids and ids[-1] in eos):
            return False  # a stop string or stop token: the text leaves some of the ids out
        while ids and ids[-1] in eos:
            ids.pop()
        if not content or not ids or content != emitted:
            return False
        with self._lock:
            key = _key(salt, content)
            self._ids[key] = tuple(ids)
            self._ids.move_to_end(key)
            while len(self._ids) > self.capacity:
                self._ids.popitem(last=False)
        return True

    def lookup(self, salt: Optional[str], text: str) -> Optional[tuple[int, ...]]:
        with self._lock:
            key = _key(salt, text)
            ids = self._ids.get(key)
            if ids is not None:
                self._ids.move_to_end(key)
            return ids


def _starts_special(text: str, specials: Sequence[str]) -> bool:
    return any(text.startswith(s) for s in specials)


def _ends_special(text: str, specials: Sequence[str]) -> bool:
    return any(text.endswith(s) for s in specials)


def encode_with_answers(
    pieces: list[Piece],
    encode_pieces: Callable[[list[Piece]], list[int]],
    specials: Sequence[str],
    lookup: Callable[[str], Optional[tuple[int, ...]]],
) -> tuple[list[int], int]:
    """Prompt ids with remembered answers spliced in: (ids, answers spliced). A client piece is
    replaced by its generated ids only between a trusted piece ending in a special token and a
    trusted piece starting with one (or the prompt's end), where the encoder's plain-text runs
    break anyway, so the rest encodes exactly as `encode_pieces(pieces)`."""
    out: list[int] = []
    segment: list[Piece] = []
    spliced = 0
    for i, (text, trusted) in enumerate(pieces):
        if not trusted and i > 0:
            before, after = pieces[i - 1], pieces[i + 1] if i + 1 < len(pieces) else None
            bounded = before[1] and _ends_special(before[0], specials)
            bounded = bounded and (after is None or (after[1] and _starts_special(after[0], specials)))
            ids = lookup(text) if bounded else None
            if ids is not None:
                out += encode_pieces(segment)
                out += ids
                segment = []
                spliced += 1
                continue
        segment.append((text, trusted))
    out += encode_pieces(segment)
    return out, spliced
