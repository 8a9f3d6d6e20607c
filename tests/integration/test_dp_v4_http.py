"""`dsv4 serve --tp-size 2 --dp-size 2` on DeepSeek-V4 (v4-tiny) as a real process, with the
official openai client: four concurrent greedy completions (prompts past the window and the
compression boundaries) read the same text as `--tp-size 1`, streamed or not, and /v1/loads names
both ranks' pools; the repeated prompts resume from the ranks' prefix caches (V4 snapshots)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from bench.harness.commands import serving_all

ARGS = ["--kv-pages", 32, "--page-size", 8, "--served-model-name", "m", "--device", "cpu"]
PROMPTS = [list(range(5 + 7 * i, 5 + 7 * i + n)) for i, n in enumerate([9, 30, 17, 24])]


def texts(url: str, stream: bool = False) -> list[str]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def one(prompt: list[int]) -> str:
        kw = dict(model="m", prompt=prompt, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
        if not stream:
            return client.completions.create(**kw).choices[0].text
        return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, PROMPTS))


@pytest.mark.slow
def test_v4_dp2_serves_the_same_text_as_tp1(make_model, tmp_path):
    model = make_model("v4-tiny")
    with serving_all(
        [
            (["--model", model, *ARGS], tmp_path / "tp1.log"),
            (["--model", model, *ARGS, "--tp-size", 2, "--dp-size", 2], tmp_path / "dp2.log"),
        ]
    ) as (tp1, dp2):
        ref = texts(tp1)
        assert texts(dp2) == ref and texts(dp2, stream=True) == ref
        loads = httpx.get(f"{dp2}/v1/loads").json()
        assert loads["dp_size"] == 2 and [r["kv_pages_total"] for r in loads["dp_ranks"]] == [32, 32]
        # the streamed pass repeats the prompts: resumed from each rank's own snapshots
        cache = loads["prefix_cache"]
        assert cache["enabled"] and cache["hit_tokens"] > 0, cache
        assert sum(r["snapshots_restored"] for r in cache["ranks"]) > 0, cache["ranks"]
    assert all(ref)
