"""The URL a decode engine gives prefill for aborts: never a wildcard address, which in a pod
is prefill's own loopback (issue 32, item 7)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dsv4_engine.pd.common import PDSettings, advertised_url


@pytest.mark.parametrize(
    "host,advertise,env,url",
    [
        ("0.0.0.0", None, {"POD_IP": "10.1.2.3"}, "http://10.1.2.3:8100"),  # in a pod: the downward API's IP
        ("0.0.0.0", "decode-0.svc", {"POD_IP": "10.1.2.3"}, "http://decode-0.svc:8100"),  # explicit wins
        ("127.0.0.1", None, {"POD_IP": "10.1.2.3"}, "http://127.0.0.1:8100"),  # a concrete listen address
        ("0.0.0.0", None, {}, "http://127.0.0.1:8100"),  # `dsv4 up`-style: one machine
        ("::", None, {"POD_IP": "fd00::5"}, "http://[fd00::5]:8100"),  # IPv6 pod
    ],
)
def test_advertised_url(host, advertise, env, url) -> None:
    assert advertised_url(host, 8100, advertise, env) == url


def test_settings_never_advertise_the_wildcard() -> None:
    args = SimpleNamespace(
        host="0.0.0.0", port=8100, advertise_host=None, bootstrap_timeout=1.0, transfer_timeout=1.0, waiting_timeout=2.0
    )
    assert PDSettings.from_args(args, {"POD_IP": "10.9.8.7"}).url == "http://10.9.8.7:8100"
