"""`dsv4 up --mono --dp-size 2` on the tiny V3 preset: the engine runs two attention replicas
(rank 1 a real process, gloo on 127.0.0.1), and the official openai client gets completions
through the router, four at once, the greedy text the same as a one-rank engine's; the engine's
/v1/loads shows both ranks' pools."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from bench.harness.commands import Proc, free_port_block

PROMPTS = ["the quick brown fox", "after the storm", "a tale of two", "once upon a time"]


def wait_json(path, timeout: float, log) -> dict:
    deadline = time.monotonic() + timeout
    while not path.is_file():
        assert time.monotonic() < deadline, log()
        time.sleep(0.2)
    return json.loads(path.read_text())


def greedy(client: openai.OpenAI, prompt: str) -> str:
    r = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage is not None and r.usage.completion_tokens == 16
    return r.choices[0].text


def up(model, tmp_path, name: str, *flags) -> tuple[Proc, int]:
    port = free_port_block()
    proc = Proc(
        ["up", "--mono", "--model", model, "--port", port, "--no-watchdog", *flags]
        + ["--engine-arg=--served-model-name=tiny", "--engine-arg=--kv-pages=64", "--engine-arg=--device=cpu"],
        tmp_path / f"{name}.log",
        env={"DSV4_CACHE": str(tmp_path / name), "COLUMNS": "80"},
    )
    return proc, port


@pytest.mark.slow  # two dsv4 up deployments (one of two ranks): ~1 min on 2 cores
def test_dsv4_up_dp2_serves_the_openai_client_through_the_router(tiny_model, tmp_path):
    texts = {}
    for name, flags in (("tp1", []), ("dp2", ["--dp-size", "2"])):
        proc, port = up(tiny_model, tmp_path, name, *flags)
        url = f"http://127.0.0.1:{port}"
        try:
            proc.wait_ready(url, timeout=240)
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=120, max_retries=0)
            with ThreadPoolExecutor(len(PROMPTS)) as pool:
                texts[name] = list(pool.map(lambda p: greedy(client, p), PROMPTS))
            if name == "dp2":
                state = tmp_path / name / "up" / str(port)
                engine = wait_json(state / "processes.json", 30, proc.log)["mono-0"]
                token = (state / "admin-token").read_text().strip()
                r = httpx.get(
                    f"http://127.0.0.1:{engine['port']}/v1/loads", headers={"Authorization": f"Bearer {token}"}
                )
                assert r.status_code == 200, r.text
                loads = r.json()
                assert loads["dp_size"] == 2 and len(loads["dp_ranks"]) == 2, loads
                assert loads["kv_pages_total"] == 2 * loads["dp_ranks"][0]["kv_pages_total"], loads
        finally:
            proc.stop()
    assert texts["dp2"] == texts["tp1"] and all(texts["tp1"]), texts
