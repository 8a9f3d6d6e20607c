"""Every option of `dsv4 router`, declared once (dsv4_wire.options):
`dsv4_router.router_args.RouterArgs` and the command's parameters are made from it; the
operator's manifests write its flags."""

from __future__ import annotations

from typing import Mapping

from dsv4_wire.auth import ADMIN_TOKEN_ENV, PD_SECRET_ENV
from dsv4_wire.options import Option, in_scopes, secret

_O = Option  # short: the tables below are read as tables
ROUTER_OPTIONS: tuple[Option, ...] = (
    _O("prefill", str, (), "Prefill engine URL (repeat for more).", scope="router", repeat=True),
    _O("decode", str, (), "Decode engine URL (repeat for more).", scope="router", repeat=True),
    _O("mono", str, (), "Monolithic engine URL (repeat for more).", scope="router", repeat=True),
    _O("host", str, "127.0.0.1", "Address to listen on.", scope="router"),
    _O("port", int, 8000, "Port of the OpenAI API.", scope="router"),
    _O("discover_namespace", str, None, "Find engine pods in this Kubernetes namespace.", scope="router"),
    _O("selector", str, None, "Label selector for discovery, e.g. app.kubernetes.io/instance=x.", scope="router"),
    _O(
        "owners",
        str,
        (),
        "Discover only pods controlled by this StatefulSet (repeat for more): labels alone can be put on any pod.",
        scope="router",
        flag="--owner",
        repeat=True,
    ),
    _O("health_interval", float, 2.0, "Seconds between /ready checks of each worker.", scope="router"),
    _O("health_timeout", float, 2.0, "Seconds one /ready check of a worker may take.", scope="router", min=0.1),
    *secret(
        "admin_token",
        "Token required by /admin (prefer --admin-token-file: argv is visible to every "
        "user). Without one, /admin/workers answers loopback clients only.",
        "router",
        ADMIN_TOKEN_ENV,
    ),
    *secret("pd_secret", "Shared secret sent with internal requests to PD engines.", "router", PD_SECRET_ENV),
    _O(
        "engine_wait_timeout",
        float,
        30.0,
        "Seconds a new request waits for a healthy engine (prefill/decode pair) when none is, as while the only "
        "one of a role restarts, before a 503; 0: the 503 at once.",
        scope="router",
        min=0.0,
    ),
    _O(
        "stall_check_after",
        float,
        3.0,
        "Seconds a request may wait on an engine with nothing from it (or 20 times its stream's mean gap, "
        "whichever is longer) before the router checks that engine's /ready: one that does not answer, or is "
        "not ready, is frozen: it leaves the rotation and its requests move to another engine. 0: off.",
        scope="router",
        min=0.0,
    ),
    _O("request_timeout", float, 600.0, "Seconds an engine may stay silent on a request.", scope="router", min=1.0),
    _O(
        "max_inflight",
        int,
        256,
        "Most requests inside the router at once (prefill + decode legs); more wait in the queue.",
        scope="router",
        min=1,
    ),
    _O(
        "max_queue", int, 256, "Most requests waiting for a slot; more get 429 with Retry-After.", scope="router", min=0
    ),
    _O("queue_timeout", float, 30.0, "Seconds a request may wait for a slot before 429.", scope="router", min=0.001),
    _O(
        "max_body_bytes",
        int,
        None,
        "Largest request body accepted (413 beyond); default: 1 MiB + 32 bytes per token of the "
        "engines' context length, at most 16 MiB.",
        scope="router",
        min=1,
    ),
    _O(
        "migration_limit",
        int,
        3,
        "Times a request whose engine failed it mid-answer is sent again (with its answer "
        "so far) to another engine; 0: off.",
        scope="router",
        min=0,
    ),
    _O(
        "migration_timeout",
        float,
        60.0,
        "Seconds a request may spend, in all, being moved to another engine (waiting for one to be healthy included).",
        scope="router",
        min=0.1,
    ),
    _O(
        "cache_events",
        bool,
        True,
        "Do not follow the engines' KV cache events: place requests by prefix affinity on the "
        "conversation's start, as before (by default the router follows every engine's "
        "/v1/kv_events and sends each request where its prompt costs least: what the engine "
        "holds of it against its load).",
        scope="router",
        flag="--no-cache-events",
    ),
    _O(
        "tokenizer",
        str,
        None,
        "Checkpoint folder whose tokenizer and chat format the router uses to turn text and chat "
        "prompts into the token ids the engines will cache, so they are placed by what each engine "
        "holds too (without it only prompts sent as token ids are; the others go by affinity).",
        scope="router",
    ),
    _O(
        "chat_template",
        str,
        None,
        "The engines' --chat-template, when they were given one (with --tokenizer).",
        scope="router",
    ),
    _O(
        "otlp_traces_endpoint",
        str,
        None,
        "Export OpenTelemetry traces (OTLP/HTTP) to this URL, e.g. http://collector:4318 (off by default).",
        scope="router",
    ),
    # Tenancy (dsv4_router.tenancy): client keys, per-key limits, the cache salt from the key, and
    # the key the router shows mono engines that require one (PD engines take the PD secret).
    _O(
        "api_keys",
        list,
        (),
        "Client API keys (dsv4_wire.api_keys.ApiKey), from --api-key and --api-key-file.",
        scope="router",
        cli=False,
    ),
    _O("api_key", str, (), "Client API key required on /v1/* (repeat for more).", scope="command", repeat=True),
    _O("api_key_file", str, (), "File of API keys, one a line (`KEY` or `NAME KEY`).", scope="command", repeat=True),
    _O(
        "key_max_concurrency",
        int,
        0,
        "Requests one API key may have in flight (0: no limit; more get 429 with Retry-After).",
        scope="router",
        min=0,
    ),
    _O(
        "key_rate_limit", float, 0.0, "Requests per second one API key may send (0: no limit).", scope="router", min=0.0
    ),
    _O(
        "key_rate_burst",
        float,
        0.0,
        "Requests one key may send at once above the rate (default: max(1, rate)).",
        scope="router",
        min=0.0,
    ),
    _O(
        "client_timeout",
        float,
        30.0,
        "Seconds a client has to send a request's headers, and then its body (slower: cut off, 408).",
        scope="router",
        min=0.1,
    ),
    _O(
        "max_connections",
        int,
        4096,
        "Connections and requests served at once (more: 503).",
        scope="router",
        min=1,
    ),
    _O(
        "cache_salt_from_api_key",
        bool,
        False,
        "Give each API key its own prefix-cache namespace (cache_salt); the default whenever keys are set.",
        scope="router",
    ),
    _O(
        "shared_prefix_cache",
        bool,
        False,
        "Let all API keys share one prefix-cache namespace (opt-out of the per-key cache_salt): "
        "cached_tokens then tells one key whether another key's prompt prefix is cached.",
        scope="router",
    ),
    _O(
        "engine_api_key",
        str,
        None,
        "Key the router shows mono engines started with --api-key (PD engines take the PD secret).",
        scope="router",
        envvar="DSV4_ENGINE_API_KEY",
    ),
)
del _O

ROUTER_OPTIONS_BY_NAME: Mapping[str, Option] = {o.name: o for o in ROUTER_OPTIONS}
ROUTER_SCOPES = ("router", "command")  # every option of `dsv4 router`


def router_options(*scopes: str) -> list[Option]:
    return in_scopes(ROUTER_OPTIONS, *scopes)
