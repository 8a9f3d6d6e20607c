"""The running `dsv4 serve`: the HTTP process (the PID started) has neither torch nor numpy
mapped after serving every kind of request, while its engine core child has torch; in a PD
role too, after checking PD requests' bootstrap fields."""

from __future__ import annotations

from pathlib import Path

import httpx

from bench.harness.commands import Proc, free_port


def _mapped(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def _rss_mib(pid: int) -> float:
    line = next(ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def test_http_process_has_no_torch_and_its_core_has(tiny_model, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = Proc(["serve", "--model", tiny_model, "--port", port, "--kv-pages", 64], tmp_path / "serve.log")
    try:
        proc.wait_ready(url)
        info = httpx.get(f"{url}/server_info").json()
        assert info["pid"] == proc.popen.pid
        # Every path that could import something lazily: completions and chat, streamed or not,
        # with logprobs, stop strings and seeds, a bad request, metrics, loads, stacks.
        r = httpx.post(
            f"{url}/v1/completions",
            json={"prompt": "hello", "max_tokens": 4, "logprobs": 2, "stop": ["zz"], "seed": 1},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        r = httpx.post(
            f"{url}/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
                "stream": True,
                "logprobs": True,
                "top_logprobs": 1,
            },
            timeout=60,
        )
        assert r.status_code == 200 and "[DONE]" in r.text, r.text
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "x", "temperature": -1}).status_code == 400
        # Structured outputs: the HTTP process checks the fields, the core compiles the grammar.
        r = httpx.post(
            f"{url}/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 8,
                "stream": True,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
            },
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert (
            httpx.post(f"{url}/v1/completions", json={"prompt": "x", "guided_regex": "(["}, timeout=60).status_code
            == 400
        )
        for path in ("/metrics", "/v1/loads", "/debug/stacks", "/health", "/v1/models"):
            assert httpx.get(f"{url}{path}", timeout=30).status_code == 200, path
        _assert_torch_only_in_core(info)
    finally:
        proc.stop()


def _assert_torch_only_in_core(info: dict) -> None:
    http_maps, core_maps = _mapped(info["pid"]), _mapped(info["engine_pid"])
    rss = f"HTTP process {_rss_mib(info['pid']):.0f} MiB, core {_rss_mib(info['engine_pid']):.0f} MiB"
    assert "libtorch" not in http_maps, f"torch is loaded in the HTTP process ({rss})"
    assert "/numpy/" not in http_maps, f"numpy is loaded in the HTTP process ({rss})"
    assert "libtorch" in core_maps, rss  # the check above can fail: the core has it


def test_prefill_role_http_process_has_no_torch_either(tiny_model, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = Proc(
        [
            "serve",
            "--model",
            tiny_model,
            "--port",
            port,
            "--kv-pages",
            64,
            "--role",
            "prefill",
            "--bootstrap-timeout",
            1,
        ],
        tmp_path / "serve.log",
    )
    try:
        proc.wait_ready(url)
        info = httpx.get(f"{url}/server_info").json()
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
        assert r.status_code == 400 and "router" in r.json()["error"]["message"], r.text  # no bootstrap fields
        body = {
            "prompt": [5, 6, 7],
            "max_tokens": 2,
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": free_port(),
            "bootstrap_room": 7,
        }
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)  # no decode there: its deadline ends it
        assert 400 <= r.status_code < 600 and "error" in r.json(), r.text
        _assert_torch_only_in_core(info)
    finally:
        proc.stop()
