"""A real `dsv4 serve --speculative-algorithm mtp` answers the official client exactly as an
engine without speculation does (greedy, concurrent requests, stop strings, max_tokens), counts
drafts and accepted tokens on /metrics, shows the mean acceptance length on /v1/loads, refuses
fields it cannot honour with a 400 naming them, and refuses to start where it cannot speculate."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from dsv4_testutil import free_port, serving
from dsv4_wire import EngineFlags
from dsv4_wire.metrics import metric_name

PROMPTS = [list(range(5, 5 + n)) for n in (3, 11, 20, 34)]
MAX_TOKENS = [9, 16, 5, 12]


@pytest.fixture(scope="module")
def tiny_mtp(tmp_path_factory):
    from dsv4_engine.checkpoint import init_checkpoint

    return init_checkpoint(tmp_path_factory.mktemp("mtp") / "tiny-mtp", preset="tiny", seed=0, mtp=True)


def _plain(model) -> list[tuple[list[int], str, str]]:
    """What an engine without speculation answers (in-process, same model and device)."""
    import torch

    from dsv4_engine.engine import Engine
    from dsv4_engine.engine_args import EngineArgs
    from dsv4_engine.sampling_params import SamplingParams
    from dsv4_engine.sequence import Sequence

    torch.set_num_threads(1)
    engine = Engine(EngineArgs(model=str(model), device="cpu", kernel_backend="torch", kv_pages=64))
    out: dict = {}
    done = threading.Event()

    def sink(o):
        toks, text, _ = out.get(o.rid, ([], "", None))
        out[o.rid] = (toks + list(o.token_ids), text + o.text, o.finish_reason)
        if o.finished and sum(v[2] is not None for v in out.values()) == len(PROMPTS):
            done.set()

    engine.start()
    try:
        for i, (p, m) in enumerate(zip(PROMPTS, MAX_TOKENS)):
            engine.submit(Sequence(f"r{i}", p, SamplingParams(max_tokens=m, temperature=0, ignore_eos=True), sink=sink))
        assert done.wait(120)
    finally:
        engine.stop()
    return [out[f"r{i}"] for i in range(len(PROMPTS))]


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
        for (toks, text, _), a in zip(plain, answers):
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
        with pytest.raises(openai.BadRequestError, match="presence_penalty"):
            client.completions.create(model="m", prompt=[5, 6], max_tokens=3, presence_penalty=0.5)


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
