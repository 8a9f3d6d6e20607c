"""One admin-auth rule for every dsv4 HTTP surface: `Authorization: Bearer <token>`.

Engines and the router check admin endpoints against the admin token, and engine-to-engine PD
endpoints against the PD secret, with the same rule; callers (router, operator, `dsv4 up`'s
watchdog, the PD controllers) build their header with `authorization_header`.
"""

from __future__ import annotations

import hmac
import ipaddress
from typing import Mapping, Optional

ADMIN_TOKEN_ENV = "DSV4_ADMIN_TOKEN"
PD_SECRET_ENV = "DSV4_PD_SECRET"


def bearer_token(headers: Mapping[str, str]) -> Optional[str]:
    """The token of an `Authorization: Bearer ...` header, or None."""
    auth = headers.get("authorization") or headers.get("Authorization") or ""
    scheme, _, token = auth.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def token_matches(headers: Mapping[str, str], expected: Optional[str]) -> bool:
    """True when no token is required, or the request carries exactly `expected`."""
    if not expected:
        return True
    got = bearer_token(headers)
    return got is not None and hmac.compare_digest(got.encode(), expected.encode())


def is_loopback(host: Optional[str]) -> bool:
    try:
        return host is not None and ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def admin_refusal(
    headers: Mapping[str, str], token: Optional[str], client_host: Optional[str]
) -> Optional[tuple[int, str]]:
    """Why an admin call is refused, as (status, message), or None when it may proceed: with a
    token configured the request must carry it; without one only loopback clients may call."""
    if token:
        return None if token_matches(headers, token) else (401, "admin token required")
    if is_loopback(client_host):
        return None
    return 403, "no admin token is configured: admin endpoints answer loopback clients only"


def authorization_header(token: Optional[str]) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}
