"""`dsv4 serve` flags that other parts write on a command line (the operator's manifests,
`dsv4 up`, benchmarks), so a renamed flag breaks one place, not three."""


class EngineFlags:
    MODEL = "--model"
    ROLE = "--role"
    HOST = "--host"
    PORT = "--port"
    BOOTSTRAP_PORT = "--bootstrap-port"
    SERVED_MODEL_NAME = "--served-model-name"
    DTYPE = "--dtype"
    BOOTSTRAP_TIMEOUT = "--bootstrap-timeout"
    TRANSFER_TIMEOUT = "--transfer-timeout"
    WAITING_TIMEOUT = "--waiting-timeout"
    NO_DEADLINES = "--no-deadlines"
    ENABLE_FAULT_INJECTION = "--enable-fault-injection"
    ADMIN_TOKEN = "--admin-token"
    PD_SECRET = "--pd-secret"
    SHUTDOWN_GRACE = "--shutdown-grace"
    DISABLE_PREFIX_CACHE = "--disable-prefix-cache"
    TRANSFER_CHECKSUM = "--transfer-checksum"
    CUDA_GRAPH_MAX_BS = "--cuda-graph-max-bs"
