"""Bodies built to hurt the operator's reader (issue 27): the metrics scan stays linear, every
read stops at its byte cap, and a malformed body becomes an error on the sample, never an
exception out of the scrape."""

import asyncio
import time

import aiohttp
import httpx
from aiohttp import web

from dsv4_operator.bounded import METRICS_MAX_BYTES, BodyTooLarge, read_capped
from dsv4_operator.remediation.scrape import make_session, scrape_engine
from dsv4_operator.watchdog.signals import _label_set_end, parse_metrics, parse_metrics_reference

GOOD = 'dsv4:num_queue_reqs{role="p"} 2\n'


def test_label_set_end_reads_quotes_escapes_and_braces():
    assert _label_set_end('a{x="}"} 1', 1) == 8
    assert _label_set_end('a{x="\\"}"} 1', 1) == 10
    assert _label_set_end('a{x="\\\\"} 1', 1) == 9  # an escaped backslash ends the value
    assert _label_set_end("a{} 1", 1) == 3
    assert _label_set_end('a{x="', 1) == -1
    assert _label_set_end('a{x="y"', 1) == -1


def test_an_unclosed_label_set_is_read_in_linear_time():
    # 11 pairs took ~10 s per line with the old regular expression, 14 pairs ~400 s.
    bomb = "dsv4:num_running_reqs{" + 'x="y" ' * 40 + " # 1\n"
    started = time.perf_counter()
    assert parse_metrics(GOOD + bomb) == parse_metrics_reference(GOOD + bomb) == {"num_queue": 2}
    assert time.perf_counter() - started < 0.5


def test_megabyte_lines_cost_time_in_proportion():
    def cost(n: int) -> float:
        text = GOOD + "dsv4:num_running_reqs{" + 'x="y",' * n + '} 3 # {a="b"} 1\n'
        started = time.perf_counter()
        assert parse_metrics(text) == {"num_queue": 2, "num_running": 3}
        return time.perf_counter() - started

    small, large = cost(20_000), cost(200_000)
    assert large < 30 * max(small, 1e-3)  # ten times the bytes: about ten times the time, not 100


async def _serve(handler):
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, "http://127.0.0.1:%d" % runner.addresses[0][1]


async def _endless(request):
    resp = web.StreamResponse()
    await resp.prepare(request)
    try:
        while True:
            await resp.write(b"dsv4:num_running_reqs 1\n" * 4096)
            await asyncio.sleep(0)
    except (ConnectionError, RuntimeError):
        pass
    return resp


async def test_an_endless_metrics_body_stops_at_the_cap_and_deep_json_is_an_error():
    async def handler(request):
        if request.path == "/metrics":
            return await _endless(request)
        return web.Response(text="[" * 100_000, content_type="application/json")

    runner, url = await _serve(handler)
    try:
        async with make_session() as session:
            started = time.perf_counter()
            s = await scrape_engine(session, url, "prefill", timeout=30)
            assert time.perf_counter() - started < 10
        assert not s.reachable
        assert f"larger than {METRICS_MAX_BYTES} bytes" in s.error and "invalid JSON" in s.error
        async with httpx.AsyncClient() as client:  # the httpx path has the same cap
            s = await scrape_engine(client, url, "prefill", timeout=30)
        assert not s.reachable and f"larger than {METRICS_MAX_BYTES} bytes" in s.error
    finally:
        await runner.cleanup()


async def test_read_capped_refuses_or_truncates():
    async def handler(request):
        if request.path == "/sized":
            return web.Response(body=b"x" * 5000)
        return await _endless(request)

    runner, url = await _serve(handler)
    try:
        async with aiohttp.ClientSession() as session:
            for path in ("/sized", "/endless"):
                async with session.get(url + path) as resp:
                    try:
                        await read_capped(resp, 1000)
                        raise AssertionError("read past the cap")
                    except BodyTooLarge as e:
                        assert e.limit == 1000
                async with session.get(url + path) as resp:
                    assert len(await read_capped(resp, 1000, truncate=True)) == 1000
            async with session.get(url + "/sized") as resp:
                assert await read_capped(resp, 5000) == b"x" * 5000
    finally:
        await runner.cleanup()
