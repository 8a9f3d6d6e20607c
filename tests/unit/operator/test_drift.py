"""Foreign list-map entries: which ones drift repair removes, and in what order."""

from __future__ import annotations

import copy

import jsonpatch

from dsv4_operator.drift import describe_removals, foreign_entry_removals


def test_a_hand_edited_service_port_and_foreign_env_and_containers_are_removed() -> None:
    wanted = {
        "spec": {
            "ports": [{"name": "http", "port": 8000, "targetPort": "http"}],
            "template": {
                "spec": {
                    "containers": [{"name": "engine", "env": [{"name": "A", "value": "1"}]}],
                    "volumes": [{"name": "dshm"}],
                }
            },
        }
    }
    live = {
        "spec": {
            "ports": [
                {"name": "http", "port": 8001, "protocol": "TCP"},
                {"name": "http", "port": 8000, "protocol": "TCP", "targetPort": "http"},
            ],
            "template": {
                "spec": {
                    "containers": [
                        {"name": "intruder"},
                        {"name": "engine", "env": [{"name": "EVIL", "value": "x"}, {"name": "A", "value": "1"}]},
                    ],
                    "volumes": [{"name": "dshm"}],
                    "tolerations": [{"key": "x"}],
                }
            },  # not a list-map, not in wanted: left alone
            "selector": {"a": "b"},
        }
    }
    ops = foreign_entry_removals(live, wanted)
    fixed = jsonpatch.apply_patch(copy.deepcopy(live), ops)
    assert fixed["spec"]["ports"] == [{"name": "http", "port": 8000, "protocol": "TCP", "targetPort": "http"}]
    assert [c["name"] for c in fixed["spec"]["template"]["spec"]["containers"]] == ["engine"]
    assert fixed["spec"]["template"]["spec"]["containers"][0]["env"] == [{"name": "A", "value": "1"}]
    assert fixed["spec"]["template"]["spec"]["tolerations"] == [{"key": "x"}]
    assert "spec.ports[0] (name=http, port=8001)" in describe_removals(live, ops)


def test_nothing_foreign_means_no_operation() -> None:
    wanted = {"spec": {"ports": [{"name": "http", "port": 8000}]}}
    live = {"spec": {"ports": [{"name": "http", "port": 8000, "protocol": "TCP", "targetPort": 8000}]}}
    assert foreign_entry_removals(live, wanted) == []


def test_a_list_never_goes_empty_between_the_patch_and_the_apply() -> None:
    """A Service whose only port was hand-edited: the patch puts ours in as it takes the foreign one
    out (a real API server refuses a ClusterIP Service without ports), and the Event names only
    the removal."""
    wanted = {
        "spec": {
            "ports": [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}],
            "template": {"spec": {"containers": [{"name": "engine", "image": "a"}]}},
        }
    }
    live = {
        "spec": {
            "ports": [{"name": "http", "port": 9999, "targetPort": "http", "protocol": "TCP"}],
            "template": {"spec": {"containers": [{"name": "engine", "image": "b"}]}},
        }
    }
    ops = foreign_entry_removals(live, wanted)
    fixed = jsonpatch.apply_patch(copy.deepcopy(live), ops)
    assert fixed["spec"]["ports"] == wanted["spec"]["ports"]
    assert fixed["spec"]["template"] == live["spec"]["template"], "a list without foreign entries is the apply's"
    assert describe_removals(live, ops) == ["spec.ports[0] (name=http, port=9999)"]


def test_foreign_labels_leave_templates_and_selectors_but_stay_on_metadata() -> None:
    """drift.py: a label on a child's own metadata is kept; one in its pod template or a selector
    changes pods or traffic and is removed (keys with a slash escaped in the JSON pointer)."""
    from dsv4_operator.drift import foreign_label_removals

    wanted = {
        "metadata": {"labels": {"app": "dsv4"}},
        "spec": {
            "selector": {"app": "dsv4", "role": "router"},
            "template": {"metadata": {"labels": {"app": "dsv4"}, "annotations": {"a": "1"}}},
        },
    }
    live = {
        "metadata": {"labels": {"app": "dsv4", "cost-center": "ml"}},
        "spec": {
            "selector": {"app": "dsv4", "role": "router", "canary": "yes"},
            "template": {
                "metadata": {
                    "labels": {"app": "dsv4", "example.com/sidecar": "on"},
                    "annotations": {"a": "1", "kubectl.kubernetes.io/restartedAt": "now"},
                }
            },
        },
    }
    ops = foreign_label_removals(live, wanted)
    fixed = jsonpatch.apply_patch(copy.deepcopy(live), ops)
    assert fixed["metadata"]["labels"] == {"app": "dsv4", "cost-center": "ml"}
    assert fixed["spec"]["selector"] == {"app": "dsv4", "role": "router"}
    assert fixed["spec"]["template"]["metadata"]["labels"] == {"app": "dsv4"}
    assert "kubectl.kubernetes.io/restartedAt" in fixed["spec"]["template"]["metadata"]["annotations"]
    assert describe_removals(live, ops) == [
        "spec.template.metadata.labels[example.com/sidecar=on]",
        "spec.selector[canary=yes]",
    ]
    # A label selector (matchLabels) is compared inside, never as a plain map.
    pdb_wanted = {"spec": {"selector": {"matchLabels": {"app": "dsv4"}}}}
    pdb_live = {"spec": {"selector": {"matchLabels": {"app": "dsv4", "x": "y"}}}}
    assert foreign_label_removals(pdb_live, pdb_wanted) == [{"op": "remove", "path": "/spec/selector/matchLabels/x"}]
