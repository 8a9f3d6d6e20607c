"""Which bootstrap target a prefill/decode engine honours (pure decision, no I/O)."""

from __future__ import annotations

import logging

import pytest

from dsv4_engine.pd import admission, bootstrap_target
from dsv4_wire import APIError


def target(role="decode", host="10.0.0.5", port=9100, room=7, *, secret_set=True, authorized=True):
    return bootstrap_target(host, port, room, role=role, secret_set=secret_set, authorized=authorized)


def test_an_authorized_request_names_its_peer():
    info = target()
    assert (info.bootstrap_host, info.bootstrap_port, info.room) == ("10.0.0.5", 9100, 7)
    assert info.bootstrap_addr == "http://10.0.0.5:9100"


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_without_the_secret_a_client_cannot_name_a_peer(role):
    with pytest.raises(APIError) as e:
        target(role, authorized=False)
    assert e.value.status == 401 and e.value.type == "authentication_error"
    assert "PD secret" in e.value.message


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_request_without_a_room_is_sent_to_the_router_first(role):
    with pytest.raises(APIError) as e:
        target(role, room=None, authorized=False)
    assert e.value.status == 400 and "router" in e.value.message and e.value.param == "bootstrap_room"


def test_with_no_secret_configured_targets_are_accepted_with_one_warning(caplog, monkeypatch):
    monkeypatch.setattr(admission, "_warned", type(admission._warned)())
    with caplog.at_level(logging.WARNING, logger="dsv4.pd"):
        target(secret_set=False, authorized=True)
        target(secret_set=False, authorized=True)
    assert [r.message for r in caplog.records if "no PD secret" in r.message] and len(caplog.records) == 1


@pytest.mark.parametrize(
    "host,port,room,param",
    [
        ("evil.example/x", 9100, 7, "bootstrap_host"),
        ("user@host", 9100, 7, "bootstrap_host"),
        ("", 9100, 7, "bootstrap_host"),
        (None, 9100, 7, "bootstrap_host"),
        ("10.0.0.5", 0, 7, "bootstrap_port"),
        ("10.0.0.5", 70000, 7, "bootstrap_port"),
        ("10.0.0.5", None, 7, "bootstrap_port"),
        ("10.0.0.5", 9100, -1, "bootstrap_room"),
        ("10.0.0.5", 9100, 2**63, "bootstrap_room"),
    ],
)
def test_decode_refuses_a_target_it_cannot_dial(host, port, room, param):
    with pytest.raises(APIError) as e:
        target("decode", host, port, room)
    assert e.value.status == 400 and e.value.param == param


def test_prefill_only_needs_the_room():
    info = target("prefill", host=None, port=None, room=3)
    assert info.room == 3
