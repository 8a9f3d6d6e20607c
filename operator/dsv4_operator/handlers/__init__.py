"""kopf handlers for DSV4Deployment, one module per subject: `registry` (the registry, start-up,
login, indexes), `apply` (the reconciler), `children` (status from the children, drift repair,
pods that cannot be created) and `watchdog_daemon` (the wedge watchdog). `dsv4_operator.main`
imports them all (each registers its handlers on `registry.registry`) and runs the registry.
"""
