"""One engine over N ranks (`--tp-size N`): sharding plans, owner-only weight loading, the
process group, the per-step batch channel and the other ranks' loop. See docs/tensor-parallel.md."""
