"""The real KV transport: NIXL (UCX) agents that WRITE pages between engines."""
