"""GET /v1/kv_events: the engine's KV cache events (dsv4_wire.kv_events, the contract), served
by the HTTP process from the core's journal (dsv4_engine.kv_journal) over the channel.

A subscription is one long response of newline-delimited JSON: the snapshot first, then every
batch of changes as the core cuts it (asked for every `POLL_S`), and a heartbeat when nothing
changed for `wire.HEARTBEAT_S`. It ends (the subscriber resubscribes: a fresh snapshot) when the
subscriber fell behind what the journal keeps, when the core stops answering, and when the
server drains, so a shutdown never waits on a subscriber. Behind the PD secret when one is set,
as the other engine-to-router surfaces. An engine without a prefix cache (decode today,
--disable-prefix-cache) serves the stream too: its snapshot is empty and stays so.
"""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from dsv4_serve.admin import require_token
from dsv4_serve.engine_client import CORE_ANSWER_TIMEOUT, EngineClient, EngineGone
from dsv4_serve.gate import Lifecycle
from dsv4_wire import APIError, Paths
from dsv4_wire import kv_events as wire

log = logging.getLogger("dsv4.server.kv_events")

POLL_S = 0.2  # how often a subscription asks the core for new batches


def add_kv_events_route(app: FastAPI, client: EngineClient, args, model_name: str, lifecycle: Lifecycle) -> None:
    @app.get(Paths.KV_EVENTS)
    async def kv_events(http: Request):
        require_token(http, args.pd_secret, "PD secret")
        try:
            snap = await client.ask("kv_snapshot", timeout=CORE_ANSWER_TIMEOUT)
        except (EngineGone, asyncio.TimeoutError) as e:
            raise APIError(f"engine process unavailable: {str(e) or 'no answer'}", 503, "server_error") from None
        first = wire.snapshot_message(
            snap["instance"],
            snap["seq"],
            snap["tiers"],
            model=model_name,
            role=args.role,
            page_size=snap["page_size"],
            boundary_tokens=snap["boundary_tokens"],
        )
        return StreamingResponse(_follow(client, first, lifecycle), media_type=wire.CONTENT_TYPE)


async def _follow(client: EngineClient, first: dict, lifecycle: Lifecycle):
    instance, seq = first["instance"], first["seq"]
    yield wire.encode(first)
    quiet_since = time.monotonic()
    while not (lifecycle.draining or lifecycle.closed):
        await asyncio.sleep(POLL_S)
        try:
            batches = await client.ask("kv_events", seq, timeout=CORE_ANSWER_TIMEOUT)
        except (EngineGone, asyncio.TimeoutError):
            return
        if batches is None:  # fell behind the journal: the subscriber starts over
            log.info("a kv events subscriber fell behind batch %d: ending its stream", seq)
            return
        for msg in batches:
            seq = msg["seq"]
            yield wire.encode(msg)
        now = time.monotonic()
        if batches:
            quiet_since = now
        elif now - quiet_since >= wire.HEARTBEAT_S:
            quiet_since = now
            yield wire.encode(wire.heartbeat_message(instance, seq))
