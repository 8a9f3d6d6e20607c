"""The router's outbound HTTP: three separate, bounded connection pools, so no kind of traffic
can starve another.

- prefill: one connection per admitted request at most, for the prefill leg;
- decode: one per admitted request at most, held for the whole stream;
- control: /ready and /server_info checks, /v1/models, admin-triggered checks, with short
  timeouts of their own.

The data pools are sized from the admission limit: every admitted request finds its prefill and
decode connection free (a request can only hold one of each), so a decode stream waiting for its
KV can never keep its own prefill leg from leaving the router -- the deadlock the single shared
pool had. Health checks never wait behind either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import httpx

from dsv4_router.stream_client import StreamClient
from dsv4_wire import authorization_header

SLACK = 8  # connections being closed (cancelled attempts) while their replacement opens
CONTROL_CONNECTIONS = 64


@dataclass(frozen=True)
class PoolPlan:
    data_connections: int
    control_connections: int


def plan_pools(max_inflight: int) -> PoolPlan:
    """Pool sizes for an admission limit. Pure."""
    return PoolPlan(data_connections=max_inflight + SLACK, control_connections=CONTROL_CONNECTIONS)


# Errors that mean the worker could not be reached at all -- the only request failures that take
# a worker out of rotation (until its next /ready check passes). An HTTP status, a timeout while
# the engine works, or an exhausted pool say nothing about the worker being gone.
CONNECTION_FAILURES = (httpx.ConnectError, httpx.ConnectTimeout)
# A connection that broke mid-answer: the worker may have died; check it now rather than wait.
BROKEN_CONNECTIONS = (httpx.ReadError, httpx.RemoteProtocolError, httpx.WriteError)


class Upstreams:
    def __init__(self, max_inflight: int, request_timeout: float, health_timeout: float, pd_secret: str | None):
        plan = plan_pools(max_inflight)
        headers = authorization_header(pd_secret)  # engines honour PD fields only with it

        def data_client() -> httpx.AsyncClient:
            n = plan.data_connections
            return httpx.AsyncClient(
                headers=headers,
                limits=httpx.Limits(max_connections=n, max_keepalive_connections=n, keepalive_expiry=10.0),
                # pool: sized so an admitted request never waits; if it ever does, fail the
                # attempt (retried) rather than wait forever
                timeout=httpx.Timeout(request_timeout, connect=5.0, pool=10.0),
            )

        self.prefill = data_client()
        self.decode = data_client()  # https engines; plain http ones stream through `stream`
        # the relayed streams (every token passes here): the client built for it (stream_client.py)
        self.stream = StreamClient(
            headers, plan.data_connections, read_timeout=request_timeout, connect_timeout=5.0, pool_timeout=10.0
        )
        self.control = httpx.AsyncClient(
            headers=headers,
            limits=httpx.Limits(max_connections=plan.control_connections, max_keepalive_connections=16),
            timeout=httpx.Timeout(health_timeout, pool=health_timeout),
        )

    async def open_stream(self, url: str, body: dict, headers: Optional[dict] = None):
        """POST to a decode (or mono) engine, the answer open for streaming: a StreamResponse, or
        an httpx.Response for an https engine. Raises httpx's errors either way."""
        if url.startswith("http://"):
            return await self.stream.post(url, body, headers)
        return await self.decode.send(self.decode.build_request("POST", url, json=body, headers=headers), stream=True)

    async def aclose(self) -> None:
        for c in (self.prefill, self.decode, self.control):
            await c.aclose()
        await self.stream.aclose()
