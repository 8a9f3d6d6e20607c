"""EPLB's admin routes (docs/eplb.md): the expert load counters as JSON, and a rebalance.

GET /admin/expert_loads: every MoE layer's tokens per logical expert and per rank, and the
placement; the body is what `--ep-loads-file` reads back. POST /admin/eplb/rebalance: place the
experts again between two steps, from the loads counted since the last rebalance, or from a
loads table given as the body (a recorded run's). Both behind the admin token."""

from __future__ import annotations

import asyncio

from fastapi import Request

from dsv4_serve.admin import require_admin
from dsv4_serve.engine_client import CORE_ANSWER_TIMEOUT, EngineGone
from dsv4_wire import APIError, Paths

REBALANCE_TIMEOUT_S = 130.0  # a rebalance may read experts from the checkpoint on every rank


def add_eplb_routes(app, client, args) -> None:
    async def ask(name: str, arg=None, timeout: float = CORE_ANSWER_TIMEOUT):
        try:
            return await client.ask(name, arg, timeout=timeout)
        except (EngineGone, asyncio.TimeoutError) as e:
            raise APIError(f"engine process unavailable: {str(e) or 'no answer'}", 503, "server_error") from None

    @app.get(Paths.ADMIN_EXPERT_LOADS)
    async def expert_loads(http: Request):
        require_admin(http, args.admin_token)
        table = await ask("expert_loads")
        if table is None:
            raise APIError("this model has no learned-routing MoE layers (no expert loads)", 404, code="not_found")
        return table

    @app.post(Paths.ADMIN_EPLB_REBALANCE)
    async def rebalance(http: Request):
        require_admin(http, args.admin_token)
        raw = await http.body()
        loads = None
        if raw.strip():
            try:
                loads = await http.json()
            except Exception:
                raise APIError("body must be JSON: a loads table (GET /admin/expert_loads) or empty") from None
            if not isinstance(loads, dict):
                raise APIError("body must be a loads table (GET /admin/expert_loads) or empty")
        report, why = await ask("eplb_rebalance", loads, timeout=REBALANCE_TIMEOUT_S)
        if report is None:
            raise APIError(why)
        return report
