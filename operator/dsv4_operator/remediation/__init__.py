"""The wedge watchdog's I/O: reading engines and carrying out the policy's actions.

``scrape`` fetches /metrics and /v1/loads (aiohttp); ``runner`` sequences one round (scrape ->
detector -> policy -> executor), shared by the Kubernetes operator and `dsv4 up`; ``actions``
says what each action means for both executors; ``executor`` acts on pods (evidence ConfigMap,
draining label, admin endpoints, eviction); ``daemon`` runs the rounds for one DSV4Deployment
as a kopf daemon, persists the policy state and the revision history in annotations of the
resource, and rolls a bad spec back when asked to. The decisions are `dsv4_operator.watchdog`'s.
"""
