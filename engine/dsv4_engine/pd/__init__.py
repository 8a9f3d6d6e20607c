"""Prefill/decode disaggregation: role controllers that plug into the engine loop, the prefill's
bootstrap server, and the HTTP endpoints PD adds to an engine (faults, peer aborts)."""

from __future__ import annotations

from fastapi import FastAPI, Request

from dsv4_engine.pd.common import BOOT_ID, FaultInjector


def attach_role(engine, args) -> None:
    """Give a prefill or decode engine its controller (and NIXL agent)."""
    engine.faults = FaultInjector()
    if args.role == "prefill":
        from dsv4_engine.pd.prefill import PrefillController

        engine.pd = PrefillController(engine, args, engine.faults)
    elif args.role == "decode":
        from dsv4_engine.pd.decode import DecodeController

        engine.pd = DecodeController(engine, args, engine.faults)
    else:
        raise ValueError(f"no PD controller for role {args.role!r}")


def _room(body) -> tuple[int, str]:
    from dsv4_engine.protocol import APIError

    if not isinstance(body, dict) or not isinstance(body.get("room"), int):
        raise APIError("body must be {\"room\": int, \"reason\": str}")
    return body["room"], str(body.get("reason", "aborted by peer"))


def extend_app(app: FastAPI, engine, args) -> None:
    """Endpoints every PD engine adds: peer aborts and, when enabled, fault injection."""
    from dsv4_engine.protocol import APIError
    from dsv4_engine.server import _admin_guard

    @app.post("/pd/abort")
    async def pd_abort(http: Request):
        room, reason = _room(await http.json())
        engine.call(lambda: engine.pd.abort_room(room, reason))
        return {"aborted": room}

    if not args.enable_fault_injection:
        return

    @app.post("/admin/faults")
    async def arm_fault(http: Request):
        _admin_guard(args, http)
        try:
            body = await http.json()
            name, count = body["fault"], int(body.get("count", 1))
            params = {k: v for k, v in body.items() if k not in ("fault", "count")}
            engine.faults.arm(name, count, **params)
        except (KeyError, TypeError, ValueError) as e:
            raise APIError(f"bad fault request: {e}")
        return {"armed": engine.faults.snapshot()}

    @app.delete("/admin/faults")
    async def clear_faults(http: Request):
        _admin_guard(args, http)
        engine.faults.clear()
        return {"armed": {}}

    @app.get("/admin/faults")
    async def list_faults(http: Request):
        _admin_guard(args, http)
        return {"armed": engine.faults.snapshot()}


def build_bootstrap_app(engine) -> FastAPI:
    """The prefill's bootstrap endpoint: decode engines register rooms, abort them, heartbeat."""
    from dsv4_engine.protocol import APIError
    from dsv4_engine.server import error_response

    app = FastAPI(title="dsv4 bootstrap", docs_url=None, redoc_url=None)
    ctl = engine.pd

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return error_response(e)

    @app.post("/bootstrap/register")
    async def register(http: Request):
        body = await http.json()
        try:
            ctl.register(body)
        except (KeyError, TypeError, ValueError) as e:
            raise APIError(f"bad registration: {e}")
        return {"ok": True, "boot_id": BOOT_ID}

    @app.post("/bootstrap/abort")
    async def abort(http: Request):
        room, reason = _room(await http.json())
        engine.call(lambda: ctl.abort_room(room, reason))
        return {"aborted": room}

    @app.get("/bootstrap/heartbeat")
    async def heartbeat(decode_boot: str = ""):
        if decode_boot:
            ctl.heartbeat(decode_boot)
        return {"boot_id": BOOT_ID}

    @app.get("/health")
    async def health():
        return {"status": "ok", "boot_id": BOOT_ID}

    return app
