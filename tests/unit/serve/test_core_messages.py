"""The byte format between the HTTP process and the engine core: what goes in comes out."""

from __future__ import annotations

import pytest

from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.request_output import RequestOutput
from dsv4_serve import core_messages as m


def test_a_request_round_trips_with_every_sampling_field():
    params = SamplingParams(
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        top_k=3,
        seed=-(2**63),
        stop=["\n\n", "x"],
        stop_token_ids=[4, 5],
        ignore_eos=True,
        logprobs=2,
    )
    msg = m.loads(
        m.dumps(m.add_msg(9, "cmpl-1", [1, 2, 3], params, ("10.0.0.1", 9100, 2**63 - 1), True, 12.5, "cmpl-0", [7, 8]))
    )
    assert isinstance(msg, m.Add)
    assert (msg.key, msg.rid, msg.prompt_ids, msg.pd, msg.prefill_only, msg.arrival, msg.share_prefix_of) == (
        9,
        "cmpl-1",
        [1, 2, 3],
        ("10.0.0.1", 9100, 2**63 - 1),
        True,
        12.5,
        "cmpl-0",
    )
    assert m.params_of(msg.params) == params
    assert msg.output_ids == [7, 8]  # a migrated request's answer so far


def test_a_structured_output_constraint_round_trips():
    from dsv4_engine.structured.spec import StructuredSpec

    params = SamplingParams(max_tokens=5, structured=StructuredSpec("json_schema", '{"type": "object"}'))
    row = m.loads(m.dumps(m.add_msg(1, "r", [1], params, None, False, 0.0))).params
    assert m.params_of(row) == params


def test_an_output_round_trips_with_logprobs_and_errors():
    lp = [{"token_id": 3, "logprob": -0.25, "top": [[3, -0.25], [8, -1.5]]}]
    out = RequestOutput("r", [3], "é", True, "stop", None, 500, 4, 1, lp)
    key, back = m.output_of(m.loads(m.dumps(m.Out([m.output_row(5, out)]))).rows[0], "r")
    assert key == 5 and back == out
    err = RequestOutput("r", [], "", True, "abort", "request aborted: x", 503, 4, 0)
    assert m.output_of(m.output_row(1, err), "r")[1] == err


def test_remote_errors_keep_the_kinds_callers_catch():
    with pytest.raises(ValueError, match="unknown fault"):
        m.raise_remote(m.loads(m.dumps(m.reply_error(1, ValueError("unknown fault 'x'")))).value)
    with pytest.raises(m.RemoteError) as e:
        m.raise_remote(("ZeroDivisionError", "boom"))
    assert e.value.kind == "ZeroDivisionError"


def test_objects_are_not_accepted_on_the_wire():
    with pytest.raises(ValueError):  # marshal refuses anything but plain values
        m.dumps(m.Out([object()]))


def test_rpc_answers_with_numpy_or_torch_scalars_become_plain():
    import numpy as np
    import torch

    value = {"a": np.int64(3), "b": (torch.tensor(0.5), {1, 2}), "c": [np.float32(1.5)], "d": object}
    assert m.loads(m.dumps(m.Reply(1, True, m.plain(value)))).value == {
        "a": 3,
        "b": [0.5, [1, 2]],
        "c": [1.5],
        "d": str(object),
    }


def test_every_kind_round_trips_as_itself():
    """Each message kind comes back as its own type with its fields (receivers dispatch on it)."""
    samples = [
        m.Init({"model": "/m"}),
        m.Hello({"pid": 1}),
        m.Fatal("x"),
        m.Refused("y"),
        m.Abort(None, "r", "why", True),
        m.Finish(3),
        m.Call(4, "loads"),
        m.Out([]),
        m.Reply(4, True, [1]),
    ]
    for msg in samples:
        back = m.loads(m.dumps(msg))
        assert type(back) is type(msg) and back == msg
    assert len(set(m.KINDS)) == len(m.KINDS)


def test_an_output_row_follows_request_output_fields():
    """The row's order is RequestOutput's own (rid aside), so a field added there cannot shift it."""
    from dataclasses import fields

    assert m.OUTPUT_FIELDS == tuple(f.name for f in fields(RequestOutput) if f.name != "rid")
