"""The runtime tokenizer: round trips, special tokens, the chat template and incremental decoding,
checked against transformers loading the same folder (offline)."""

from __future__ import annotations

import json
import os
import random

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers

from dsv4_engine.checkpoint import corpus_lines, train_tokenizer
from dsv4_engine.tokenizer import (
    ASSISTANT_TOKEN,
    BOS_TOKEN,
    CHAT_TEMPLATE,
    EOS_TOKEN,
    USER_TOKEN,
    IncrementalDetokenizer,
    Tokenizer,
    render_chat,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEXTS = [
    "Hello world",
    " leading and trailing spaces  ",
    "The weather today is 17 degrees, with a 70% chance of rain.",
    "def add(a, b):\n    return a + b\n",
    "Tabs\tand\r\nnewlines\n\n\nand \x00 control \x7f bytes",
    "今天天气很好，我们去公园散步吧。",
    "明日は雨 — 오늘은 맑음 — Καλημέρα — café naïve",
    "emoji: 😊🚀 family: 👨‍👩‍👧 flag: 🇵🇹 skin: 👍🏽",
    "math ∑∫√∞ and rare 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 and \U0010fffd",
    "",
]

CHATS = [
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Sunny."},
        {"role": "user", "content": "And tomorrow? 😊"},
    ],
    [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "two "},
                {"type": "image_url", "image_url": {"url": "x"}},
                {"type": "text", "text": "parts"},
            ],
        }
    ],
    [
        {"role": "system", "content": "one"},
        {"role": "user", "content": "q"},
        {"role": "system", "content": "two"},
        {"role": "assistant", "content": None},
    ],
    [
        {"role": "system", "content": ""},
        {"role": "system", "content": "after an empty one"},
        {"role": "user", "content": ""},
    ],
]


@pytest.fixture(scope="module")
def tok(tiny_model) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model)


@pytest.fixture(scope="module")
def hf_tok(tiny_model):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(tiny_model)


def test_special_tokens_and_sizes(tok):
    assert tok.vocab_size == 512
    assert tok.bos_id == 0 and tok.eos_ids == [1] and tok.eos_token == EOS_TOKEN
    assert tok.encode("x")[0] == tok.bos_id and tok.encode("x", add_bos=False)[0] != tok.bos_id
    ids = tok.encode(f"{USER_TOKEN}hi{ASSISTANT_TOKEN}", add_bos=False)
    assert ids[0] == tok.backend.token_to_id(USER_TOKEN) and ids[-1] == tok.backend.token_to_id(ASSISTANT_TOKEN)
    full = [tok.bos_id, *ids, tok.eos_ids[0]]
    assert tok.decode(full) == "hi"
    assert tok.decode(full, skip_special_tokens=False) == f"{BOS_TOKEN}{USER_TOKEN}hi{ASSISTANT_TOKEN}{EOS_TOKEN}"


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_bpe_learned_the_corpus(tok):
    """A trained BPE, not bytes: corpus prose takes well under one token per character, and the
    tokenizer is the same whenever it is trained."""
    text = "\n".join(corpus_lines()[:100])
    assert len(tok.encode(text, add_bos=False)) < 0.6 * len(text.encode())  # measured 0.45
    assert train_tokenizer().to_str() == tok.backend.to_str()


def test_same_as_transformers(tok, hf_tok):
    assert len(hf_tok) == tok.vocab_size
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id) == (tok.bos_id, tok.eos_ids[0])
    for text in TEXTS + [f"{USER_TOKEN}hi{ASSISTANT_TOKEN}there{EOS_TOKEN}"]:
        assert hf_tok(text).input_ids == tok.encode(text)
        ids = hf_tok(text, add_special_tokens=False).input_ids
        assert ids == tok.encode(text, add_bos=False)
        assert hf_tok.decode(ids, skip_special_tokens=True) == tok.decode(ids)
        assert hf_tok.decode(ids, skip_special_tokens=False) == tok.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("gen_prompt", [True, False])
@pytest.mark.parametrize("chat", range(len(CHATS)))
def test_chat_template_python_equals_jinja_in_transformers(tok, hf_tok, chat, gen_prompt):
    messages = CHATS[chat]
    expected = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen_prompt)
    assert tok.apply_chat_template(messages, add_generation_prompt=gen_prompt) == expected
    # The same template through our own jinja path (used for foreign templates) agrees too.
    foreign = Tokenizer(tok.backend, BOS_TOKEN, [EOS_TOKEN], chat_template=CHAT_TEMPLATE + "{# foreign #}")
    assert foreign.apply_chat_template(messages, add_generation_prompt=gen_prompt) == expected


def test_chat_template_shape_and_errors(tok, hf_tok):
    text = tok.apply_chat_template(CHATS[1])
    assert text == (
        f"{BOS_TOKEN}Be brief.{USER_TOKEN}Weather?{ASSISTANT_TOKEN}Sunny.{EOS_TOKEN}"
        f"{USER_TOKEN}And tomorrow? 😊{ASSISTANT_TOKEN}"
    )
    assert tok.encode(text, add_bos=False)[0] == tok.bos_id
    bad = [{"role": "tool", "content": "x"}]
    with pytest.raises(ValueError, match="unsupported chat role"):
        tok.apply_chat_template(bad)
    with pytest.raises(Exception, match="unsupported chat role"):
        hf_tok.apply_chat_template(bad, tokenize=False)
    with pytest.raises(ValueError):
        Tokenizer(tok.backend, BOS_TOKEN, [EOS_TOKEN], chat_template=None).apply_chat_template(CHATS[0])
    assert render_chat(CHATS[0], add_generation_prompt=False) == f"{BOS_TOKEN}{USER_TOKEN}Hi"


def test_loads_a_folder_that_transformers_saved(tok, hf_tok, tmp_path):
    """transformers >= 5 writes the template to chat_template.jinja and no add_bos_token."""
    hf_tok.save_pretrained(tmp_path)
    assert (tmp_path / "chat_template.jinja").exists()
    other = Tokenizer.from_dir(tmp_path)
    assert (other.bos_id, other.eos_ids, other.vocab_size) == (tok.bos_id, tok.eos_ids, tok.vocab_size)
    for text in TEXTS:
        assert other.encode(text) == tok.encode(text)
    for messages in CHATS:
        assert other.apply_chat_template(messages) == tok.apply_chat_template(messages)


def test_loads_foreign_config_forms(tiny_model, tmp_path):
    """Special tokens as AddedToken dicts, several end ids in generation_config, no bos in use."""
    (tmp_path / "tokenizer.json").write_bytes((tiny_model / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": {"content": BOS_TOKEN, "special": True},
                "eos_token": {"content": EOS_TOKEN},
                "add_bos_token": False,
                "chat_template": [{"name": "default", "template": "{{ messages[0]['content'] }}!"}],
            }
        )
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 3]}))
    other = Tokenizer.from_dir(tmp_path)
    assert other.bos_id == 0 and other.eos_ids == [1, 3]
    assert other.encode("hi") == other.encode("hi", add_bos=False)
    assert other.apply_chat_template([{"role": "user", "content": "hey"}]) == "hey!"
    (tmp_path / "tokenizer_config.json").unlink()  # no config at all: ids from generation_config
    bare = Tokenizer.from_dir(tmp_path)
    assert bare.eos_ids == [1, 3] and bare.chat_template is None
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_dir(tmp_path / "nowhere")


def _stream(tok, ids, prompt_ids=(), skip_special_tokens=True):
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt_ids, skip_special_tokens=skip_special_tokens)
    deltas = [detok.add(i) for i in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == detok.text
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_decode_equals_full_decode(tok, text):
    ids = tok.encode(text, add_bos=False)
    deltas = _stream(tok, ids)
    assert "".join(deltas) == text
    # No delta carries half a character: each one is whole text, nothing replaced.
    assert not any("\ufffd" in d for d in deltas)
    assert all(d.encode("utf-8").decode("utf-8") == d for d in deltas)


def test_incremental_decode_holds_back_split_characters(tok):
    ids = tok.encode("😊", add_bos=False)
    assert len(ids) > 1  # the emoji is spelled in byte tokens
    detok = IncrementalDetokenizer(tok)
    assert [detok.add(i) for i in ids] == [""] * (len(ids) - 1) + ["😊"]


def test_incremental_decode_with_prompt_context_and_specials(tok):
    prompt = tok.encode("User says: 今天", add_bos=True)
    generated = tok.encode("天气 fine 👍🏽 ok", add_bos=False) + tok.eos_ids
    assert "".join(_stream(tok, generated, prompt_ids=prompt)) == tok.decode(generated)
    with_eos = "".join(_stream(tok, generated, skip_special_tokens=False))
    assert with_eos == tok.decode(generated, skip_special_tokens=False) and with_eos.endswith(EOS_TOKEN)


def test_incremental_decode_random_ids(tok):
    """Whatever a random model emits — stray continuation bytes, specials — the stream adds up
    to the full decode, and only the final flush may end inside a character."""
    rng = random.Random(7)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        deltas = _stream(tok, ids)
        assert "".join(deltas) == tok.decode(ids)
        assert not any(d.endswith("\ufffd") for d in deltas[:-1])


def test_incremental_decode_sentencepiece_style_tokenizer():
    """A Llama-style tokenizer (metaspace, byte fallback, strip the first space): decoding one id
    alone would lose or add spaces; the windowed stream still matches the full decode."""
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
    for ch in "▁abcdefghijklmnopqrstuvwxyzTW,.":
        vocab.setdefault(ch, len(vocab))
    merges = []
    for word in ["▁the", "▁weather", "▁is", "▁fine"]:  # left-to-right merges that build each word
        for end in range(2, len(word) + 1):
            merges.append((word[: end - 1], word[end - 1]))
            vocab.setdefault(word[:end], len(vocab))
    sp = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    sp.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    sp.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    foreign = Tokenizer(sp, bos_token=None, eos_tokens=[])
    text = "The weather is fine, 今天 😊"
    ids = foreign.encode(text)
    assert any(sp.id_to_token(i).startswith("<0x") for i in ids) and sp.token_to_id("▁weather") in ids
    assert foreign.decode(ids) == text
    assert "".join(_stream(foreign, ids)) == text
    # After a prompt, the first generated word keeps its space (a lone decode would strip it).
    cut = ids.index(sp.token_to_id("▁weather"))
    prompt, generated = ids[:cut], ids[cut:]
    expected = foreign.decode(ids)[len(foreign.decode(prompt)) :]
    assert expected.startswith(" ") and "".join(_stream(foreign, generated, prompt_ids=prompt)) == expected
