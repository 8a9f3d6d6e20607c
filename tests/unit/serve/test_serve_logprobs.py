"""The OpenAI logprobs shapes, as pure functions over the engine's per-token entries."""

from __future__ import annotations

from dsv4_serve.logprobs import (
    _byte_level_alphabet,
    byte_level_token_bytes,
    chat_logprobs,
    completion_logprobs,
    next_offset,
    text_of_bytes,
)


def test_byte_level_alphabet_spells_every_byte_once():
    alphabet = _byte_level_alphabet()
    assert sorted(alphabet.values()) == list(range(256))
    assert alphabet["Ġ"] == ord(" ") and alphabet["a"] == ord("a")
    assert byte_level_token_bytes("Ġthe") == b" the"
    assert byte_level_token_bytes("<|eos|>\u4e00") is None  # not a byte-level spelling


def test_partial_utf8_is_shown_as_bytes():
    assert text_of_bytes("é".encode()) == "é"
    assert text_of_bytes(b"\xc3") == "bytes:\\xc3"


TEXT = {1: "Hel", 2: "lo", 3: " world", 4: "\ufffd"}
RAW = {1: b"Hel", 2: b"lo", 3: b" world", 4: b"\xe4"}
ENTRIES = [
    {"token_id": 1, "logprob": -0.5, "top": [[1, -0.5], [2, -1.5]]},
    {"token_id": 2, "logprob": -2.0, "top": [[3, -0.25]]},
    {"token_id": 3, "logprob": -0.1, "top": []},
]


def test_completion_shape_offsets_and_sampled_token_in_top():
    lp = completion_logprobs(ENTRIES, TEXT.__getitem__, offset=4)
    assert lp["tokens"] == ["Hel", "lo", " world"]
    assert lp["token_logprobs"] == [-0.5, -2.0, -0.1]
    assert lp["text_offset"] == [4, 7, 9]
    assert lp["top_logprobs"][1] == {" world": -0.25, "lo": -2.0}  # the sampled token is always there
    assert lp["top_logprobs"][2] == {" world": -0.1}
    assert next_offset(lp, 4) == 15 and next_offset(completion_logprobs([], TEXT.__getitem__), 15) == 15


def test_chat_shape_carries_raw_bytes():
    lp = chat_logprobs([{"token_id": 4, "logprob": -1.0, "top": [[4, -1.0], [1, -2.0]]}], RAW.__getitem__)
    (item,) = lp["content"]
    assert item["token"] == "bytes:\\xe4" and item["bytes"] == [0xE4] and item["logprob"] == -1.0
    assert item["top_logprobs"] == [
        {"token": "bytes:\\xe4", "logprob": -1.0, "bytes": [0xE4]},
        {"token": "Hel", "logprob": -2.0, "bytes": list(b"Hel")},
    ]
