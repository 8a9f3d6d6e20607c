"""The wedge watchdog: scrape -> detect -> decide -> act.

Pure parts (no I/O, no clock): ``signals`` (one scrape -> EngineSample), ``detector`` (samples ->
Healthy/Slow/Wedged/Unreachable), ``policy`` (verdicts + budget state -> ordered actions),
``revisions`` (spec history, change naming, rollback), ``evidence`` (the evidence ConfigMap).
The thin I/O shell is ``scrape``; acting on Kubernetes or local processes lives with the caller.
"""
