"""The wedge watchdog's decisions, all pure (no I/O): what to conclude and what to do.

``signals`` (one scrape -> EngineSample; ScrapeTarget), ``detector`` (samples ->
Healthy/Slow/Wedged/Unreachable), ``corroboration`` (when the operator's own view of reachability
counts), ``policy`` (verdicts + budget state -> ordered actions), ``revisions`` (spec history,
change naming, rollback), ``evidence`` (the evidence ConfigMap's body), ``pods`` (a deployment's
engine pods -> scrape targets and what the policy knows of them), ``report`` (a round -> the
Wedged condition, status fields and Events). The I/O that feeds and carries them out is
`dsv4_operator.remediation`; tests/unit/house checks that nothing here does I/O.
"""
