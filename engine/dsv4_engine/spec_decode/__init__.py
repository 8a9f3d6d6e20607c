"""Speculative decoding with a checkpoint's own multi-token-prediction (MTP) layer.

- `options`: the flag's spellings and what an engine or a request cannot run with it (pure).
- `mtp_layer`: the MTP block (DeepSeek-V3's layout) and its own paged KV state.
- `verify`: greedy acceptance and rejection sampling (pure functions over probabilities).
- `speculator`: one engine step of draft-verify-catch-up over a scheduled batch.
"""
