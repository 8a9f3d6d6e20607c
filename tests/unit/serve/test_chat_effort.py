"""reasoning_effort per checkpoint family (engine/dsv4_serve/chat/effort.py): the tiers each
format declares, the tier every effort lands on, the prompt it adds, the V4 profile read from
what the checkpoint ships, and unknown efforts refused on all three APIs."""

from __future__ import annotations

import json

import pytest

from dsv4_serve.chat import ChatOptions
from dsv4_serve.chat.effort import EFFORTS, profile_declared, tier
from dsv4_serve.chat.render import render
from dsv4_serve.protocol import ChatCompletionRequest, parse_request
from dsv4_wire import APIError
from dsv4_wire.agent_apis.messages_request import messages_to_chat
from dsv4_wire.agent_apis.responses_request import responses_to_chat

USER = [{"role": "user", "content": "Hello"}]
ABSOLUTE, BEYOND = "Reasoning Effort: Absolute maximum", "Reasoning Effort: Beyond maximum"


def prompt(renderer: str, profile, effort) -> str:
    """The prompt of a chat request asking for `effort`, as the chat path renders it."""
    req = ChatCompletionRequest(messages=USER, reasoning_effort=effort)
    opts = ChatOptions(thinking=req.thinking(), reasoning_effort=effort, effort_profile=profile)
    return render(renderer, None, USER, opts).text()


def prefix(text: str):
    return next((p for p in (ABSOLUTE, BEYOND) if p in text), None)


@pytest.mark.parametrize(
    "effort, v4, preview",
    [
        ("none", None, None),
        ("minimal", None, None),
        ("low", None, None),
        ("medium", ABSOLUTE, None),
        ("high", ABSOLUTE, None),
        ("xhigh", BEYOND, ABSOLUTE),
        ("max", BEYOND, ABSOLUTE),
        (None, None, None),
    ],
)
def test_v4_efforts_land_on_the_checkpoints_tiers(effort, v4, preview):
    for profile, expected in (("v4", v4), ("v4_preview", preview)):
        text = prompt("deepseek_v4", profile, effort)
        assert prefix(text) == expected, (profile, effort)
        assert text.startswith("<｜begin▁of▁sentence｜>" + (expected or "<｜User｜>"))
        thinking = effort not in (None, "none")
        assert text.endswith("<｜Assistant｜><think>" if thinking else "<｜Assistant｜></think>"), (profile, effort)


def test_the_preview_encoder_has_one_prompted_tier_and_0731_two():
    assert {tier("v4", e) for e in EFFORTS} == {None, "low", "high", "max"}
    assert {tier("v4_preview", e) for e in EFFORTS} == {None, "high", "max"}
    assert tier("v4", None) == "low" and tier("v4_preview", None) == "high"  # each encoder's default


@pytest.mark.parametrize("renderer", ["deepseek_v31", "deepseek_v32"])
def test_v31_and_v32_have_thinking_on_or_off_and_no_effort_prompt(renderer):
    on = prompt(renderer, "thinking", "medium")
    assert prefix(on) is None and on.endswith("<think>")
    for effort in EFFORTS[1:]:
        assert prompt(renderer, "thinking", effort) == on
    assert prompt(renderer, "thinking", "none") == prompt(renderer, "thinking", None)
    assert prompt(renderer, "thinking", "none").endswith("</think>")


def test_the_v4_profile_is_what_the_checkpoint_ships(tmp_path):
    assert profile_declared(str(tmp_path), {}) == "v4"  # no encoder shipped: DeepSeek's current one
    (tmp_path / "encoding").mkdir()
    enc = tmp_path / "encoding" / "encoding_dsv4.py"
    enc.write_text('REASONING_EFFORT_MAX = "Reasoning Effort: Absolute maximum ..."\n')
    assert profile_declared(str(tmp_path), {}) == "v4_preview"
    enc.write_text('REASONING_EFFORT_PROMPTS = {"low": "", "high": "...", "max": "..."}\n')
    assert profile_declared(str(tmp_path), {}) == "v4"
    # SGLang's config key wins over the encoder
    assert profile_declared(str(tmp_path), {"dsv4_reasoning_effort_profile": "preview"}) == "v4_preview"
    with pytest.raises(ValueError, match="dsv4_reasoning_effort_profile"):
        profile_declared(str(tmp_path), {"dsv4_reasoning_effort_profile": "turbo"})


def test_chat_setup_reads_the_profile_from_the_folder(tmp_path):
    from dsv4_engine.checkpoint import tokenizer_config, train_tokenizer
    from dsv4_engine.tokenizer import Tokenizer
    from dsv4_serve.chat_prompt import chat_setup

    (tmp_path / "tokenizer.json").write_text(train_tokenizer().to_str(), encoding="utf-8")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(4096)), encoding="utf-8")
    tok = Tokenizer.from_dir(tmp_path)
    config = {"model_type": "deepseek_v4", "dsv4_reasoning_effort_profile": "preview"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert chat_setup(str(tmp_path), tok).effort_profile == "v4_preview"
    assert chat_setup(str(tmp_path), tok, chat_template=None).renderer == "deepseek_v4"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v32"}))
    assert chat_setup(str(tmp_path), tok).effort_profile == "thinking"


def test_an_unknown_effort_is_a_400_on_every_api():
    def chat(body: dict):
        return parse_request(ChatCompletionRequest, json.dumps(body).encode())

    for body in (
        {"messages": USER, "reasoning_effort": "turbo"},
        responses_to_chat({"input": "hi", "reasoning": {"effort": "turbo"}}).chat,
        messages_to_chat({"max_tokens": 5, "messages": USER, "output_config": {"effort": "turbo"}}).chat,
    ):
        with pytest.raises(APIError) as e:
            chat(body)
        assert e.value.status == 400 and "reasoning_effort" in e.value.message
    for effort in EFFORTS:
        chat({"messages": USER, "reasoning_effort": effort})
