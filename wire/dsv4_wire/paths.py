"""HTTP paths of the engines, the prefill bootstrap server and the router."""


class Paths:
    # OpenAI surface (engines and router)
    COMPLETIONS = "/v1/completions"
    CHAT_COMPLETIONS = "/v1/chat/completions"
    MODELS = "/v1/models"
    # the agent harnesses' APIs, translated onto chat completions (dsv4_wire.agent_apis)
    RESPONSES = "/v1/responses"  # OpenAI Responses; GET/DELETE /v1/responses/{id} for stored ones
    MESSAGES = "/v1/messages"  # Anthropic Messages
    MESSAGES_COUNT_TOKENS = "/v1/messages/count_tokens"  # Anthropic's prompt token count
    # live state (every engine)
    HEALTH = "/health"
    READY = "/ready"
    METRICS = "/metrics"
    LOADS = "/v1/loads"
    SERVER_INFO = "/server_info"
    # KV cache events (dsv4_wire.kv_events): newline-delimited JSON, snapshot first
    KV_EVENTS = "/v1/kv_events"
    # sessions (named conversations whose prefix is pinned a while): DELETE SESSIONS/{id}
    SESSIONS = "/v1/sessions"
    # admin (behind the admin token when one is set)
    ADMIN_DRAIN = "/admin/drain"
    ADMIN_ABORT = "/admin/abort"
    ADMIN_FAULTS = "/admin/faults"  # only with --enable-fault-injection
    DEBUG_STACKS = "/debug/stacks"
    ADMIN_EXPERT_LOADS = "/admin/expert_loads"  # GET: every MoE layer's expert load counters (EPLB)
    ADMIN_EPLB_REBALANCE = "/admin/eplb/rebalance"  # POST: place the experts again, between two steps
    ADMIN_WORKERS = "/admin/workers"  # router
    # engine to engine (behind the PD secret when one is set)
    PD_ABORT = "/pd/abort"
    BOOTSTRAP_REGISTER = "/bootstrap/register"
    BOOTSTRAP_ABORT = "/bootstrap/abort"
    BOOTSTRAP_HEARTBEAT = "/bootstrap/heartbeat"


# Paths that answer in Anthropic's shape (errors at the door too)
ANTHROPIC_PATHS = frozenset({Paths.MESSAGES, Paths.MESSAGES_COUNT_TOKENS})
