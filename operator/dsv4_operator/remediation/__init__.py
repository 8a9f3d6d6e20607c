"""The wedge watchdog on Kubernetes: one loop per DSV4Deployment, run as a kopf daemon.

``pods`` (pure) turns the deployment's engine pods into scrape targets and what the policy needs
to know about them; ``report`` (pure) turns a round into the Wedged condition and the status
fields the watchdog owns; ``executor`` acts on pods (evidence ConfigMap, draining label,
admin endpoints, delete); ``daemon`` runs the rounds (shared with `dsv4 up` through
``dsv4_operator.watchdog.runner``), persists the policy state and the revision history in
annotations of the resource, and rolls a bad spec back when asked to.
"""
