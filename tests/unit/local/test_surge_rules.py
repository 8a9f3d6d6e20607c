"""`dsv4 up`'s surge (local/surge.py), its pure parts: where the new engine goes and how the
commands that name the old one change."""

from __future__ import annotations

from dsv4_operator.local.surge import BOOTSTRAP_PORTS, HTTP_PORTS, pick_port, replaced_url, surge_by_default, with_value


def test_the_new_port_is_the_first_one_nobody_holds_and_that_binds():
    taken = [8001, 8002]
    assert pick_port(8000, HTTP_PORTS, taken, bindable=lambda p: True) == 8003
    assert pick_port(8000, HTTP_PORTS, taken, bindable=lambda p: p != 8003) == 8004
    assert pick_port(8000, BOOTSTRAP_PORTS, [8100], bindable=lambda p: True) == 8101
    assert pick_port(8000, (1, 3), taken, bindable=lambda p: True) is None  # no room: restart in place


def test_commands_follow_the_new_engine():
    cmd = ["dsv4", "serve", "--port", "8001", "--bootstrap-port", "8100", "--role", "prefill"]
    assert with_value(cmd, "--port", "8003") == ["dsv4", "serve", "--port", "8003", "--bootstrap-port", "8100"] + [
        "--role",
        "prefill",
    ]
    router = ["dsv4", "router", "--prefill", "http://127.0.0.1:8001", "--decode", "http://127.0.0.1:8002"]
    assert replaced_url(router, "http://127.0.0.1:8001", "http://127.0.0.1:8003")[3] == "http://127.0.0.1:8003"


def test_no_surge_by_default_on_a_gpu():
    assert surge_by_default(gpu_present=False) and not surge_by_default(gpu_present=True)
