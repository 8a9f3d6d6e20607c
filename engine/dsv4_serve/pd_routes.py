"""HTTP endpoints PD adds to an engine: peer aborts, fault injection (when enabled), and the
prefill's bootstrap server (decode engines register rooms, abort them, heartbeat)."""

from __future__ import annotations

from fastapi import FastAPI, Request

from dsv4_engine.pd.messages import AbortRoom, RegisterRoom, registration_answer
from dsv4_serve.admin import error_response, require_admin, require_token
from dsv4_serve.gate import Gate, Lifecycle
from dsv4_wire import APIError, Paths


def _room(body) -> tuple[int, str]:
    try:
        msg = AbortRoom.of(body)
    except ValueError as e:
        raise APIError(f'body must be {{"room": int, "reason": str}}: {e}') from None
    return msg.room, msg.reason


async def _json(http: Request):
    try:
        return await http.json()
    except Exception:
        raise APIError("body must be JSON") from None


def extend_app(app: FastAPI, engine, args) -> None:
    """Endpoints every PD engine adds: peer aborts and, when enabled, fault injection (armed on
    the controller's injector, which its transport, channel and deadline policy consult)."""
    faults = engine.pd.faults

    @app.post(Paths.PD_ABORT)
    async def pd_abort(http: Request):
        require_token(http, args.pd_secret, "PD secret")
        room, reason = _room(await _json(http))
        engine.call(lambda: engine.pd.abort_room(room, reason))
        return {"aborted": room}

    if not args.enable_fault_injection:
        return

    @app.post(Paths.ADMIN_FAULTS)
    async def arm_fault(http: Request):
        require_admin(http, args.admin_token)
        try:
            body = await http.json()
            name, count = body["fault"], int(body.get("count", 1))
            params = {k: v for k, v in body.items() if k not in ("fault", "count")}
            faults.arm(name, count, **params)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise APIError(f"bad fault request: {e}") from None
        return {"armed": faults.snapshot()}

    @app.delete(Paths.ADMIN_FAULTS)
    async def clear_faults(http: Request):
        require_admin(http, args.admin_token)
        faults.clear()
        return {"armed": {}}

    @app.get(Paths.ADMIN_FAULTS)
    async def list_faults(http: Request):
        require_admin(http, args.admin_token)
        return {"armed": faults.snapshot()}


def build_bootstrap_app(engine, args) -> FastAPI:
    """The prefill's bootstrap endpoint: decode engines register rooms, abort them, heartbeat."""
    app = FastAPI(title="dsv4 bootstrap", docs_url=None, redoc_url=None, openapi_url=None)
    # a caller without the PD secret is refused before its body is read; bodies here are small
    app.add_middleware(
        Gate, lifecycle=Lifecycle(), max_request_bytes=1 << 20, pd_secret=getattr(args, "pd_secret", None)
    )
    ctl = engine.pd

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return error_response(e)

    @app.post(Paths.BOOTSTRAP_REGISTER)
    async def register(http: Request):
        require_token(http, args.pd_secret, "PD secret")
        body = await _json(http)
        try:
            ctl.register(RegisterRoom.of(body))
        except ValueError as e:
            raise APIError(f"bad registration: {e}") from None
        return registration_answer(ctl.boot_id)

    @app.post(Paths.BOOTSTRAP_ABORT)
    async def abort(http: Request):
        require_token(http, args.pd_secret, "PD secret")
        room, reason = _room(await _json(http))
        engine.call(lambda: ctl.abort_room(room, reason))
        return {"aborted": room}

    @app.get(Paths.BOOTSTRAP_HEARTBEAT)
    async def heartbeat(http: Request, decode_boot: str = ""):
        require_token(http, args.pd_secret, "PD secret")
        if decode_boot:
            ctl.heartbeat(decode_boot)
        return {"boot_id": ctl.boot_id}

    @app.get(Paths.HEALTH)
    async def health():
        return {"status": "ok", "boot_id": ctl.boot_id}

    return app
