"""Rollouts that prove themselves: before the rest of a role moves to a new engine revision, one
engine (the canary) gets a probe shaped like the workload that broke us — a replayed agent
conversation whose context grows every round — and a verdict decides keep or revert.

- `conversation`: the replayed conversation, pure (token ids, no model output needed);
- `probe`: runs it against one engine (through the router, pinned) for a bounded time: figures;
- `verdict`: canary figures + stable figures + the watchdog's signals -> pass or fail, pure.
`dsv4 up --reconfigure` (dsv4_operator.local.reconfigure) and the operator (dsv4_operator.rollout) use them."""
