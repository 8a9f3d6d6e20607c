"""The engine's serving surface: the OpenAI-compatible HTTP API, health, metrics, admin and the
HTTP endpoints PD adds (peer aborts, the prefill's bootstrap server, fault injection)."""
