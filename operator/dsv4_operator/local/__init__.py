"""`dsv4 up`: the operator's local twin. The same wedge detector, remediation policy and canary
as on a cluster, carried out on local processes instead of pods: `up` (the deployment and its
executor), `supervisor` (restarts processes that died), `reconfigure` (`dsv4 up --reconfigure`)
and `state_files` (the state folder's atomic writes). Nothing else of dsv4_operator imports this
package (tests/unit/house/test_import_graph.py): the Kubernetes operator does not carry it."""
