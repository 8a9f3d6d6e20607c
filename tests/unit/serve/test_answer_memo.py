"""A chat client's re-sent answer rendered with the ids the model generated
(dsv4_serve.chat.answer_memo): on DeepSeek-V3.1's and V4's formats, round 2's prompt ids start with
round 1's prompt ids followed by the answer's generated ids (what the prefix cache holds), where
tokenizing the same text again gives other ids; a changed answer or another tenant's salt fall
back to plain tokenizing; an answer the client did not get whole (a parser took part of it, a stop
string cut it) is not remembered; the memo is bounded."""

from __future__ import annotations

import json

import pytest

from dsv4_serve.chat import ChatOptions, render
from dsv4_serve.chat.answer_memo import AnswerMemo, encode_with_answers

ANSWER = "The tool says the weather in Paris is sunny and warm today."


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from dsv4_engine.checkpoint import tokenizer_config, train_tokenizer
    from dsv4_engine.tokenizer import Tokenizer

    d = tmp_path_factory.mktemp("tok")
    (d / "tokenizer.json").write_text(train_tokenizer().to_str(), encoding="utf-8")
    (d / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(4096)), encoding="utf-8")
    return Tokenizer.from_dir(d)


def generated_ids(tok, text: str) -> list[int]:
    """Ids that spell `text` but are not how it tokenizes (a model's sampled split)."""
    plain = tok.encode_plain(text)
    for cut in range(2, len(text) - 1):
        ids = tok.encode_plain(text[:cut]) + tok.encode_plain(text[cut:])
        if ids != plain and tok.decode(ids, skip_special_tokens=False) == text:
            return ids
    raise AssertionError("no split of the answer tokenizes differently")


def rounds(answer: str) -> tuple[list[dict], list[dict]]:
    first = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "weather in Paris?"}]
    return first, first + [{"role": "assistant", "content": answer}, {"role": "user", "content": "and tomorrow?"}]


def encode(tok, memo, pieces, salt=None):
    return encode_with_answers(pieces, tok.encode_pieces, tok.added_tokens, lambda t: memo.lookup(salt, t))


@pytest.mark.parametrize("renderer", ["deepseek_v31", "deepseek_v4"])
def test_round_two_carries_the_generated_ids(tokenizer, renderer):
    tok = tokenizer
    gen = generated_ids(tok, ANSWER)
    memo = AnswerMemo()
    # ended by its eos token, which the format writes itself after the content
    assert memo.remember(None, ANSWER, gen + tok.eos_ids[:1], ANSWER, tok.eos_ids, "stop")
    first, second = rounds(ANSWER)
    p1 = tok.encode_pieces(render(renderer, None, first, ChatOptions()).pieces)
    pieces = render(renderer, None, second, ChatOptions()).pieces
    plain = tok.encode_pieces(pieces)
    ids, spliced = encode(tok, memo, pieces)
    assert spliced == 1
    assert ids[: len(p1)] == p1 and ids[len(p1) : len(p1) + len(gen)] == gen
    assert plain[len(p1) : len(p1) + len(gen)] != gen  # what tokenizing the text again gives
    assert tok.decode(ids, skip_special_tokens=False) == tok.decode(plain, skip_special_tokens=False)
    # a client that changed the answer, or another tenant: tokenized as without the memo
    _, edited = rounds(ANSWER + " ")
    edited_pieces = render(renderer, None, edited, ChatOptions()).pieces
    assert encode(tok, memo, edited_pieces) == (tok.encode_pieces(edited_pieces), 0)
    assert encode(tok, memo, pieces, salt="tenant-b") == (plain, 0)


def test_only_answers_the_client_got_whole_are_remembered(tokenizer):
    tok = tokenizer
    memo = AnswerMemo()
    ids = tok.encode_plain(ANSWER)
    assert not memo.remember(None, ANSWER[10:], ids, ANSWER)  # a parser took reasoning out of the text
    assert not memo.remember(None, ANSWER, ids, ANSWER, tok.eos_ids, "stop")  # a stop string: ids past the text
    assert not memo.remember(None, "", [], "")
    assert len(memo) == 0
    assert memo.remember(None, ANSWER, ids, ANSWER, tok.eos_ids, "length") and memo.lookup(None, ANSWER) == tuple(ids)


def test_the_memo_is_bounded_oldest_first():
    memo = AnswerMemo(capacity=2)
    for text in ("A", "B", "C"):
        assert memo.remember("s", text, [ord(text) - 65], text)
    assert memo.lookup("s", "A") is None and memo.lookup("s", "C") == (2,) and len(memo) == 2
