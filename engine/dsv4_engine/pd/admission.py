"""Which peer a PD request may name: the bootstrap fields of a prefill/decode engine's request.

A decode engine dials the `bootstrap_host:bootstrap_port` it is given, so those fields are a
way to make it connect anywhere. They are honoured only from a caller that proved it knows the
shared PD secret (the router sends `Authorization: Bearer <pd_secret>`). With no secret
configured (local development) they are accepted, with one warning per process; `dsv4 up` and
the operator always configure one.
"""

from __future__ import annotations

import logging
import threading
from typing import Optional

from dsv4_engine.pd.request_info import PDRequestInfo
from dsv4_wire import APIError

log = logging.getLogger("dsv4.pd")
_warned = threading.Event()


def bootstrap_target(
    host: Optional[str], port: Optional[int], room: Optional[int], *, role: str, secret_set: bool, authorized: bool
) -> PDRequestInfo:
    """The PD bookkeeping for a request naming this peer, or an APIError (400/401) saying why not."""
    if room is None:
        raise APIError(f"this is a {role} engine: send requests through the dsv4 router", param="bootstrap_room")
    if secret_set and not authorized:
        raise APIError(
            "bootstrap_host/bootstrap_port/bootstrap_room need the PD secret: send requests through the dsv4 router",
            401,
            "authentication_error",
            param="bootstrap_room",
        )
    if not secret_set and not _warned.is_set():
        _warned.set()
        log.warning(
            "no PD secret is set (--pd-secret / DSV4_PD_SECRET): this %s engine honours bootstrap "
            "targets from any client; set one outside local development",
            role,
        )
    if not isinstance(room, int) or isinstance(room, bool) or not 0 <= room < 2**63:
        raise APIError("bootstrap_room must be an integer in [0, 2^63)", param="bootstrap_room")
    if role == "decode":
        if not host or not isinstance(host, str) or any(c in host for c in "/@?#[] "):
            raise APIError("bootstrap_host must be a bare host name or IPv4 address", param="bootstrap_host")
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            raise APIError("bootstrap_port must be an integer in [1, 65535]", param="bootstrap_port")
    return PDRequestInfo(host or "127.0.0.1", port or 0, room)
