"""The router makes every request id (issue 39 item 9): a client's rid only as a prefix, and
only from a log-safe alphabet."""

from __future__ import annotations

import pytest

from dsv4_router.request_id import MAX_CLIENT_RID_CHARS, request_id
from dsv4_wire import APIError


def test_ids_are_unique_whatever_the_client_sends():
    assert request_id(None, chat=True, unique="u1") == "chatcmpl-u1"
    assert request_id(None, chat=False, unique="u1") == "cmpl-u1"
    assert request_id("job-7.a:b_c", chat=False, unique="u1") == "job-7.a:b_c-u1"
    assert request_id("victim", chat=True) != request_id("victim", chat=True)  # no collision by choice


@pytest.mark.parametrize(
    "rid", ["", "a\nINFO forged line", "a\rb", "a b", "x" * (MAX_CLIENT_RID_CHARS + 1), "é", 7, ["r"], {"r": 1}]
)
def test_an_unsafe_rid_is_a_400(rid):
    with pytest.raises(APIError) as err:
        request_id(rid, chat=False)
    assert err.value.status == 400 and err.value.param == "rid"
