"""A real `dsv4 serve --speculative-algorithm mtp` answers the official client exactly as an
engine without speculation does (greedy, concurrent requests, stop strings, max_tokens), counts
drafts and accepted tokens on /metrics, shows the mean acceptance length on /v1/loads, serves
structured outputs (guided_json, tool_choice required) and penalties / logit_bias / min_tokens
as plain decoding does, and refuses to start where it cannot speculate."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from bench.harness.commands import free_port, serving
from dsv4_wire import EngineFlags
from dsv4_wire.metrics import metric_name

PROMPTS = [list(range(5, 5 + n)) for n in (3, 11, 20, 34)]
MAX_TOKENS = [9, 16, 5, 12]


@pytest.fixture(scope="module")
def tiny_mtp(tmp_path_factory):
    from dsv4_engine.checkpoint import init_checkpoint

    return init_checkpoint(tmp_path_factory.mktemp("mtp") / "tiny-mtp", preset="tiny", seed=0, mtp=True)


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,6}$"}, "n": {"type": "integer", "minimum": 0}},
    "required": ["name", "n"],
    "additionalProperties": False,
}
LOGITS = dict(presence_penalty=-2.0, frequency_penalty=0.5, logit_bias={"40": 3.0, "77": 2.5}, min_tokens=4)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 8}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
]


def _plain_requests():
    from dsv4_engine.sampling_params import SamplingParams
    from dsv4_engine.structured import spec as structured

    reqs = [(p, SamplingParams(max_tokens=m, temperature=0, ignore_eos=True)) for p, m in zip(PROMPTS, MAX_TOKENS)]
    reqs.append(([5, 6, 7], SamplingParams(max_tokens=60, temperature=0, structured=structured.json_schema(SCHEMA))))
    knobs = {**LOGITS, "logit_bias": {int(k): v for k, v in LOGITS["logit_bias"].items()}}
    reqs.append(([8, 9], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, **knobs)))
    return reqs


def _plain(model) -> list[tuple[list[int], str, str]]:
    """What an engine without speculation answers (in-process, same model and device)."""
    import torch

    from dsv4_engine.engine import Engine
    from dsv4_engine.engine_args import EngineArgs
    from dsv4_engine.sequence import Sequence

    torch.set_num_threads(1)
    engine = Engine(EngineArgs(model=str(model), device="cpu", kernel_backend="cpu", kv_pages=64))
    out: dict = {}
    done = threading.Event()

    def sink(o):
        toks, text, _ = out.get(o.rid, ([], "", None))
        out[o.rid] = (toks + list(o.token_ids), text + o.text, o.finish_reason)
        if o.finished and sum(v[2] is not None for v in out.values()) == len(reqs):
            done.set()

    reqs = _plain_requests()
    engine.start()
    try:
        for i, (p, params) in enumerate(reqs):
            engine.submit(Sequence(f"r{i}", p, params, sink=sink))
        assert done.wait(120)
    finally:
        engine.stop()
    return [out[f"r{i}"] for i in range(len(reqs))]


def counter(text: str, key: str) -> float:
    m = re.search(rf"^{re.escape(metric_name(key, '_total'))}{{[^}}]*}} (\S+)$", text, re.M)
    assert m, f"{key} missing from /metrics"
    return float(m.group(1))


def test_served_with_speculation_equals_plain_decoding(tiny_mtp, tmp_path):
    plain = _plain(tiny_mtp)
    args = [
        "--model",
        tiny_mtp,
        "--kv-pages",
        64,
        "--served-model-name",
        "m",
        EngineFlags.SPECULATIVE_ALGORITHM,
        "EAGLE",
        EngineFlags.SPECULATIVE_NUM_STEPS,
        2,
    ]
    with serving(args, tmp_path / "spec.log", env={"OMP_NUM_THREADS": "1"}) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)

        def ask(i: int, stop=None):
            return client.completions.create(
                model="m",
                prompt=PROMPTS[i],
                max_tokens=MAX_TOKENS[i],
                temperature=0,
                stop=stop,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            answers = list(pool.map(ask, range(len(PROMPTS))))
        for (toks, text, _), a in zip(plain[: len(PROMPTS)], answers):
            assert a.choices[0].text == text and a.choices[0].finish_reason == "length"
            assert a.usage.completion_tokens == len(toks)
            assert a.choices[0].model_extra["token_ids"] == toks
        # A stop string from the middle of a plain answer ends it there, as without speculation.
        toks, text, _ = plain[1]
        found = re.search(r"[A-Za-z]{3}", text[len(text) // 3 :])
        if found:
            a = ask(1, stop=[found.group(0)])
            assert a.choices[0].finish_reason == "stop" and a.choices[0].text == text[: text.index(found.group(0))]
        metrics = httpx.get(f"{url}/metrics").text
        assert counter(metrics, "spec_decode_num_draft_tokens") > 0
        assert counter(metrics, "spec_decode_num_accepted_tokens") >= 0
        assert "dsv4:spec_decode_accept_length_bucket" in metrics
        spec = httpx.get(f"{url}/v1/loads").json()["speculative"]
        assert spec["algorithm"] == "mtp" and spec["num_steps"] == 2 and spec["mean_acceptance_length"] >= 1
        # Structured output and logits processing: what plain decoding answers, token for token.
        toks, text, reason = plain[len(PROMPTS)]
        a = client.completions.create(
            model="m",
            prompt=[5, 6, 7],
            max_tokens=60,
            temperature=0,
            extra_body={"guided_json": SCHEMA, "return_token_ids": True},
        )
        assert a.choices[0].model_extra["token_ids"] == toks and a.choices[0].text == text and reason == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)
        toks, text, _ = plain[len(PROMPTS) + 1]
        a = client.completions.create(
            model="m",
            prompt=[8, 9],
            max_tokens=12,
            temperature=0,
            presence_penalty=LOGITS["presence_penalty"],
            frequency_penalty=LOGITS["frequency_penalty"],
            logit_bias=LOGITS["logit_bias"],
            extra_body={"min_tokens": LOGITS["min_tokens"], "ignore_eos": True, "return_token_ids": True},
        )
        assert a.choices[0].model_extra["token_ids"] == toks and a.choices[0].text == text
        # tool_choice required: the answer is a call to the tool, arguments valid under its schema.
        r = client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "weather?"}],
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=300,
            temperature=0,
        )
        assert r.choices[0].finish_reason == "tool_calls", (r.choices[0].message, r.usage)
        call = r.choices[0].message.tool_calls[0]
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), TOOLS[0]["function"]["parameters"])


def test_speculation_is_refused_in_one_line_where_it_cannot_run(tiny_model, tiny_mtp):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for model, flags, says in (
        (tiny_model, [EngineFlags.SPECULATIVE_ALGORITHM, "mtp"], "needs a checkpoint with an MTP layer"),
        (tiny_mtp, [EngineFlags.SPECULATIVE_ALGORITHM, "medusa"], "is not supported; use mtp"),
        (
            tiny_mtp,
            [EngineFlags.SPECULATIVE_ALGORITHM, "NEXTN", EngineFlags.SPECULATIVE_NUM_STEPS, 9],
            "between 1 and 8",
        ),
    ):
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "dsv4_cli",
                "serve",
                "--model",
                str(model),
                "--port",
                str(free_port()),
                *map(str, flags),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (flags, r.stdout, r.stderr)
        assert says in lines[0], lines[0]
