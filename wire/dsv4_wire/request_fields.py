"""Request-body fields only the router may set on an engine request: where a decode engine
finds its prefill (the bootstrap triple), and a migrated request's answer so far. The router
writes them, the engine's protocol reads them (its model fields carry these names; a test holds
them together), and the router strips them from what clients send."""

from __future__ import annotations

BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
CONTINUATION_FIELD = "continuation_token_ids"
ROUTER_ONLY_FIELDS = (*BOOTSTRAP_FIELDS, CONTINUATION_FIELD)
