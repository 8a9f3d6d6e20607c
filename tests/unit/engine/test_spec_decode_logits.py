"""Speculation serves what changes the logits: structured outputs (the grammar's mask on every
draft and at every verified position, the grammar state rolled back past rejected drafts) and
penalties, logit_bias and min_tokens (each position's logits from the tokens before it). Greedy
output equals plain decoding token for token, with the real drafter and with drafts steered to be
right, wrong (often outside the grammar) or half right; sampled output keeps the masked target
distribution; every page comes back."""

from __future__ import annotations

import json
import threading
from collections import Counter

import jsonschema
import pytest

from dsv4_engine.engine import Engine
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.sequence import Sequence
from dsv4_engine.structured import spec as structured
from spec_testutil import run_all as _run
from spec_testutil import spec_engine
from spec_testutil import steer as _steer


def _engine(model, spec: bool, steps: int = 3, **kw):
    return spec_engine(model, spec, steps, **{"kv_pages": 96, **kw})


pytestmark = pytest.mark.usefixtures("one_torch_thread")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "n": {"type": "integer", "minimum": 0, "maximum": 300},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "n", "tags"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer"}},
                "required": ["city", "days"],
                "additionalProperties": False,
            },
        },
    },
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}},
]


@pytest.fixture(scope="module")
def v3_mtp(tmp_path_factory):
    from dsv4_engine.checkpoint import init_checkpoint

    return init_checkpoint(tmp_path_factory.mktemp("mtp") / "tiny-mtp", preset="tiny", seed=0, mtp=True)


@pytest.fixture(scope="module")
def v4_mtp(tmp_path_factory):
    from dsv4_engine.checkpoint import init_checkpoint

    return init_checkpoint(tmp_path_factory.mktemp("v4mtp") / "v4-tiny-mtp", preset="v4-tiny", seed=0, mtp=True)


def _structured_requests() -> list:
    g = dict(temperature=0, max_tokens=120)
    return [
        ([5, 6, 7, 8], SamplingParams(structured=structured.json_schema(SCHEMA), **g)),
        ([9, 10, 11], SamplingParams(structured=structured.json_schema(SCHEMA), presence_penalty=0.7, **g)),
        ([12, 13], SamplingParams(structured=structured.StructuredSpec("regex", "[a-c]{2,5}-[0-9]{3}"), **g)),
        ([14, 15, 16], SamplingParams(structured=structured.choice(["alpha", "beta", "gamma delta"]), **g)),
        ([17, 18], SamplingParams(structured=structured.tool_calls("deepseek_v3", TOOLS, "required"), **g)),
        (
            [19, 20, 21],
            SamplingParams(
                structured=structured.tool_calls(
                    "deepseek_v3", TOOLS, {"type": "function", "function": {"name": "get_weather"}}, False
                ),
                **g,
            ),
        ),
        ([22, 23], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)),  # no grammar, same batch
    ]


def test_structured_outputs_greedy_equal_plain_with_real_and_steered_drafts(v3_mtp):
    reqs = _structured_requests()
    plain = _run(_engine(v3_mtp, False), reqs)
    assert all(v[2] == "stop" for k, v in plain.items() if k != "r6"), plain
    for n in (0, 1):
        jsonschema.validate(json.loads(plain[f"r{n}"][1]), SCHEMA)
    assert plain["r3"][1] in ("alpha", "beta", "gamma delta")
    real = _engine(v3_mtp, True, steps=3)
    assert _run(real, reqs) == plain
    assert real.metrics.totals["spec_decode_num_draft_tokens"] > 0
    eng = _engine(v3_mtp, True, steps=3)
    _steer(eng, plain, 0.75, 0)  # runs of accepted drafts, and wrong ones (mostly outside the grammar)
    assert _run(eng, reqs) == plain
    assert eng.metrics.totals.get("spec_decode_num_accepted_tokens", 0) > 50  # accepted drafts advanced the grammar


def _logits_requests(stop_tok: int) -> list:
    # Negative penalties and repetition_penalty < 1 favour tokens already seen: a random model
    # rarely repeats a token within 16, so positive ones would change nothing here.
    g = dict(temperature=0, max_tokens=16, ignore_eos=True)
    return [
        ([5, 6, 7], SamplingParams(presence_penalty=-2.0, **g)),
        ([5, 6, 7], SamplingParams(frequency_penalty=-1.5, **g)),
        ([8, 9, 10, 11], SamplingParams(repetition_penalty=0.4, **g)),
        ([12, 13], SamplingParams(logit_bias={40: 3.0, 41: -100.0, 77: 2.5}, **g)),
        ([5, 6, 7], SamplingParams(min_tokens=9, stop_token_ids=[stop_tok], temperature=0, max_tokens=16)),
        ([14, 15], SamplingParams(presence_penalty=-2.0, frequency_penalty=0.4, repetition_penalty=1.3, **g)),
        ([16, 17], SamplingParams(**g)),
    ]


def _stop_token(model) -> int:
    """A token plain greedy decoding of [5, 6, 7] emits early: min_tokens must hold it back."""
    out = _run(_engine(model, False), [([5, 6, 7], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))])
    return out["r0"][0][1]


def test_penalties_logit_bias_min_tokens_greedy_equal_plain(v3_mtp):
    reqs = _logits_requests(_stop_token(v3_mtp))
    plain = _run(_engine(v3_mtp, False), reqs)
    assert plain["r4"][2] in ("stop", "length") and len(plain["r4"][0]) >= 9
    # The knobs changed the output (else this proves nothing): against the unprocessed run.
    bare = _run(
        _engine(v3_mtp, False), [(p, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)) for p, _ in reqs]
    )
    assert sum(plain[k][0] != bare[k][0] for k in plain) >= 5
    assert _run(_engine(v3_mtp, True, steps=2), reqs) == plain
    for accuracy, seed in ((1.0, 2), (0.5, 3)):
        eng = _engine(v3_mtp, True, steps=3)
        _steer(eng, plain, accuracy, seed)
        assert _run(eng, reqs) == plain
        assert eng.metrics.totals.get("spec_decode_num_accepted_tokens", 0) > 20


def test_v4_structured_and_penalties_greedy_equal_plain(v4_mtp):
    reqs = [_structured_requests()[0], *_logits_requests(3)[:4]]
    plain = _run(_engine(v4_mtp, False), reqs)
    assert _run(_engine(v4_mtp, True, steps=2), reqs) == plain
    eng = _engine(v4_mtp, True, steps=2)
    _steer(eng, plain, 0.6, 4)
    assert _run(eng, reqs) == plain
    assert eng.metrics.totals.get("spec_decode_num_accepted_tokens", 0) > 10


def test_logprobs_under_a_grammar_equal_plain(v3_mtp):
    params = SamplingParams(temperature=0, max_tokens=40, logprobs=2, structured=structured.json_schema(SCHEMA))
    toks, lps = _run_with_logprobs(_engine(v3_mtp, False), [5, 6, 7], params)
    eng = _engine(v3_mtp, True)
    _steer(eng, {"r0": (toks,)}, 0.7, 5)
    got_toks, got_lps = _run_with_logprobs(eng, [5, 6, 7], params)
    assert got_toks == toks and len(got_lps) == len(lps) == len(toks)
    assert eng.metrics.totals.get("spec_decode_num_accepted_tokens", 0) > 5
    for a, b in zip(lps, got_lps):  # the masked distribution's: top entries inside the grammar
        assert a["token_id"] == b["token_id"] and [t for t, _ in a["top"]] == [t for t, _ in b["top"]]
        assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-4)


def _run_with_logprobs(engine: Engine, prompt: list[int], params: SamplingParams):
    got: list = []
    done = threading.Event()

    def sink(o):
        got.append(o)
        if o.finished:
            done.set()

    engine.start()
    try:
        engine.submit(Sequence("r0", prompt, params, sink=sink))
        assert done.wait(60)
    finally:
        engine.stop()
    assert got[-1].finish_reason == "stop", got[-1].error
    return [t for o in got for t in o.token_ids], [e for o in got for e in (o.logprobs or [])]


def test_sampled_under_a_grammar_keeps_the_masked_target_distribution(v3_mtp):
    """Two-sample chi-square between plain and speculative draws of a choice grammar's answer
    (several tokens each, with logit_bias and min_tokens; the spec run's drafts are verified by
    rejection sampling over the masked, processed, renormalised distributions): same
    distribution, and every answer inside the grammar."""
    options = ["a", "b", "c", "ab", "ac", "ba", "bc", "ca", "cab", "abc"]

    eng = _engine(v3_mtp, True, steps=2, max_num_seqs=32, kv_pages=160)
    # Processing too, on both distributions: logit_bias moves mass to "a"; min_tokens holds back
    # the end after one token (the second is drafted and still has a choice).
    bias = {t: 1.5 for t in eng.tokenizer.encode_plain("a")}

    def reqs(seed0: int):  # independent samples: the two runs draw with different seeds
        params = dict(
            temperature=4.0, max_tokens=8, structured=structured.choice(options), logit_bias=bias, min_tokens=2
        )
        return [([5, 6], SamplingParams(seed=seed0 + i, **params)) for i in range(160)]

    spec = _run(eng, reqs(0), timeout=300)
    plain = _run(_engine(v3_mtp, False, max_num_seqs=32, kv_pages=160), reqs(10_000), timeout=300)
    assert eng.metrics.totals["spec_decode_num_accepted_tokens"] > 50  # drafts were kept, and rejected
    a, b = Counter(v[1] for v in plain.values()), Counter(v[1] for v in spec.values())
    assert set(a) | set(b) <= set(options), (a, b)
    cats = [c for c in options if a[c] + b[c] > 0]
    n1, n2 = sum(a.values()), sum(b.values())
    chi2 = sum((a[c] * (n2 / n1) ** 0.5 - b[c] * (n1 / n2) ** 0.5) ** 2 / (a[c] + b[c]) for c in cats)
    # 99.9th percentile of chi-square with len(cats) - 1 <= 9 degrees of freedom: 27.9.
    assert chi2 < 27.9, (a, b, chi2)


def test_structured_and_penalties_under_preemption_and_through_pd(v3_mtp):
    """Preempted requests rebuild their grammar state from their output (drafts dropped) and go
    on as plain decoding does; a PD pair (prefill verifies the first token under the grammar,
    decode drafts and verifies the rest) answers what a plain engine does."""
    from test_spec_decode_pd import all_back, pair, through_pd

    s, lg = _structured_requests(), _logits_requests(3)
    reqs = [lg[0], lg[3], lg[4], s[0], s[2], s[4]]  # the newest are preempted first: the grammars
    plain = _run(_engine(v3_mtp, False), reqs)
    eng = _engine(v3_mtp, True, steps=3, kv_pages=11)
    _steer(eng, plain, 0.75, 6)
    preempted = []
    preempt = eng.scheduler._preempt
    eng.scheduler._preempt = lambda seq: (preempted.append(seq.rid), preempt(seq))
    assert _run(eng, reqs) == plain
    assert {"r3", "r4", "r5"} & set(preempted), "the pool was meant to be small enough to preempt"
    p, d = pair(v3_mtp, True, True)
    assert through_pd(p, d, reqs) == {k: (v[0], v[2], v[3]) for k, v in plain.items()}
    assert d.metrics.totals["spec_decode_num_draft_tokens"] > 0
    all_back(p, d)


def test_pending_tokens_count_as_output():
    """process_logits with `pending` tokens after a history equals it with them in the output."""
    import torch

    from dsv4_engine.sampling import process_logits

    class H:
        def __init__(self, prompt, output):
            self.prompt_ids, self.output_ids = prompt, output

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 50, generator=gen)
    p = SamplingParams(
        presence_penalty=0.7, frequency_penalty=-0.4, repetition_penalty=1.6, logit_bias={3: 2.0}, min_tokens=5
    )
    params, eos = [p, p, p], [7]
    base = H([1, 2, 3], [4, 4, 9])
    pend = [[], [4], [11, 12, 13]]
    got = process_logits(x, params, [base, base, base], eos, pending=pend)
    want = process_logits(x, params, [H([1, 2, 3], [4, 4, 9] + t) for t in pend], eos)
    assert torch.equal(got, want)
    assert torch.isneginf(got[1, 7]) and not torch.isneginf(got[2, 7])  # min_tokens counts them too


def test_fill_along_masks_each_state_and_rolls_back():
    """The mask after tokens[:j] for every j, the matcher where it began afterwards; it stops at a
    refused token and after the one that completes the grammar."""
    import torch
    import xgrammar as xgr

    from dsv4_engine.structured.bitmask import fill_along
    from dsv4_engine.structured.grammar import Matcher

    info = xgr.TokenizerInfo(["a", "b", "c", "</s>"], xgr.VocabType.RAW, vocab_size=4, stop_token_ids=[3])
    compiled = xgr.GrammarCompiler(info).compile_grammar('root ::= "a" ("b" | "c") "a"')
    m = Matcher(compiled)
    host = torch.full((5, 1), -1, dtype=torch.int32)
    assert fill_along(m, [0, 1, 0, 3], host, 0) == (4, 4)  # a b a </s>: four taken, no state after </s>
    bits = [v & 0b1111 for v in host[:, 0].tolist()]  # the 4 tokens' bits (xgrammar sets the others at will)
    assert bits[:4] == [0b0001, 0b0110, 0b0001, 0b1000] and host[4, 0] == -1
    assert fill_along(m, [0, 0, 1], host, 0) == (1, 2)  # the second "a" is refused
    # A draft step's mask: the state after all the tokens only, into row 1.
    assert fill_along(m, [0, 2], host, 1, skip=2) == (2, 1) and host[1, 0] & 0b1111 == 0b0001
    m.sync([0])  # the matcher is where it began: nothing accepted
    host.fill_(-1)
    m.fill(host, 0)
    assert host[0, 0] & 0b1111 == 0b0110


def test_auto_tool_grammar_greedy_equal_plain_with_drafts(v3_mtp):
    """`tool_choice: "auto"` (free text, then a call block) under MTP: the structural tag's state
    rolls back past rejected drafts like any grammar. The call-opening token is biased so a block
    is entered and finished."""
    from dsv4_engine.tokenizer import Tokenizer
    from dsv4_wire import chat_tokens as T

    opener = Tokenizer.from_dir(v3_mtp).encode_pieces([(T.TOOL_CALLS_BEGIN, True)])[0]
    g = dict(temperature=0, max_tokens=80)
    reqs = [
        ([5, 6, 7], SamplingParams(structured=structured.tool_calls("deepseek_v31", TOOLS, "auto"), **g)),
        (
            [8, 9],
            SamplingParams(
                structured=structured.tool_calls("deepseek_v31", TOOLS, "auto"), logit_bias={opener: 8.0}, **g
            ),
        ),
        ([10, 11], SamplingParams(structured=structured.tool_calls("deepseek_v3", TOOLS, "auto", False), **g)),
    ]
    plain = _run(_engine(v3_mtp, False), reqs)
    assert T.TOOL_CALLS_BEGIN in plain["r1"][1] and plain["r1"][2] == "stop"  # a call was opened and finished
    assert _run(_engine(v3_mtp, True, steps=3), reqs) == plain
    eng = _engine(v3_mtp, True, steps=3)
    _steer(eng, plain, 0.75, 0)
    assert _run(eng, reqs) == plain
