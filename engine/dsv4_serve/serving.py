"""The OpenAI handlers of the engine's HTTP process: requests validated, tokenised and templated
(on a worker thread, so /health and /ready answer while a multi-megabyte prompt is processed),
fanned out to n choices, sent to the engine core through `engine_client.EngineClient`, and
answered as one body or a stream. Every error a client sees is an OpenAI error body
(`dsv4_wire.APIError`), in a stream too (an error event, then [DONE]).

The FastAPI app that routes to them is `app.build_app`; the process that runs it is `process`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import traceback
import uuid
from dataclasses import dataclass, replace
from typing import AsyncIterator, Mapping, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.request_output import RequestOutput
from dsv4_engine.tokenizer import Tokenizer
from dsv4_serve.sessions import session_of, with_session
from dsv4_serve.detokenize import OutputProcessor
from dsv4_serve.engine_client import EngineClient, EngineRequest
from dsv4_serve.awaiting import Awaiting, Held
from dsv4_serve.gate import Lifecycle
from dsv4_serve.logprobs import byte_level_token_bytes, chat_logprobs, completion_logprobs, next_offset, text_of_bytes
from dsv4_serve.chat import ChatSetup, tool_parser
from dsv4_serve.chat_prompt import chat_setup as prompt_chat_setup, chat_tools, longest_token_chars, render_chat
from dsv4_serve.chat.output import ChatOutput, reasoning_tokens
from dsv4_serve.chat.answer_memo import AnswerMemo, encode_with_answers
from dsv4_serve.chat.tool_choice import tool_choice_spec
from dsv4_serve.choices import best_choices, choice_room
from dsv4_serve.server_args import ServerArgs
from dsv4_serve.protocol import ChatCompletionRequest, CompletionRequest, NamedToolChoice, _Common, parse_request
from dsv4_wire import tracing
from dsv4_wire.tracing import Tracing
from dsv4_wire import APIError, token_matches
from dsv4_wire.choices import choice_seed

log = logging.getLogger("dsv4.server")


def internal_error(ref: str) -> APIError:
    """What a client learns of a bug: that it happened and where the log has it, never the
    exception's text (paths, peer addresses, other requests' data)."""
    return APIError(f"internal error (reference {ref}: see the engine's log)", 500, "server_error")


def _usage(prompt: int, completion: int, cached: int = 0, reasoning: Optional[int] = None) -> dict:
    """OpenAI usage; `cached`: prompt tokens the prefix cache served (OpenAI's and vLLM's
    prompt_tokens_details.cached_tokens); `reasoning`: completion tokens spent thinking, when a
    reasoning parser runs."""
    # min: a continuation (migration) may find part of its earlier answer cached too
    usage = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": min(cached, prompt)},
    }
    if reasoning is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return usage


def chat_setup(args: ServerArgs, tokenizer: Tokenizer) -> ChatSetup:
    """The checkpoint's chat format, then the server's flags."""
    return prompt_chat_setup(args.model, tokenizer, args.chat_template, args.tool_call_parser, args.reasoning_parser)


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, allow_nan=False)}\n\n"


class _ClientGone(Exception):
    """The client left before the request's first output."""


def _failure(out: RequestOutput) -> APIError:
    """The client-facing error of a request the engine ended with an error or abort."""
    code = out.error_code if out.error_code >= 400 else 500
    if code == 429:  # --max-queued-requests: the engine is full, the request is fine
        return APIError(out.error or "the engine's queue is full", 429, "rate_limit_error", code="queue_full")
    return APIError(out.error or "request failed", code, "server_error" if code >= 500 else "invalid_request_error")


@dataclass
class Prepared:
    """A request validated and tokenised (off the event loop), ready for the engine."""

    req: _Common
    seqs: list[EngineRequest]
    rid: str
    chat: bool
    outputs: Optional[list[ChatOutput]] = None  # chat: one output parser per choice
    span: object = None  # this engine's span of the request (tracing on)
    held: Optional[Held] = None  # counted in Awaiting until its first output (awaiting.py)


class OpenAIServing:
    def __init__(
        self, client: EngineClient, tokenizer: Tokenizer, args: ServerArgs, lifecycle: Optional[Lifecycle] = None
    ):
        self.client = client
        self.tokenizer = tokenizer
        self.lifecycle = lifecycle or Lifecycle()
        self.args = args
        self.awaiting = Awaiting()  # requests here with no output from the core yet
        self.tracing = Tracing(args.otlp_traces_endpoint, f"dsv4-{args.role}")
        self.model_name = args.served_model_name
        self.vocab = client.vocab_size
        self.max_model_len = client.max_model_len
        self._token_bytes: dict[int, bytes] = {}
        from tokenizers import decoders

        self._byte_level = isinstance(getattr(tokenizer.backend, "decoder", None), decoders.ByteLevel)
        self._max_token_chars = longest_token_chars(tokenizer)
        self.chat_setup = chat_setup(args, tokenizer)
        tokenizer.encode_plain("warm")  # builds the plain-text tokenizer now, not on the first chat
        self._think_end_id = tokenizer.backend.token_to_id("</think>")
        # Answers this engine generated, by text, so a chat client's re-sent answer finds its KV
        # (chat/answer_memo.py). Prefill never sees an answer: it renders as today.
        memo = getattr(args, "chat_answer_memo", 0)
        self.answers = AnswerMemo(memo) if memo and args.role != "prefill" else None

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (for logprobs), cached: the vocabulary is bounded."""
        raw = self._token_bytes.get(token_id)
        if raw is None:
            raw = None
            if self._byte_level:
                raw = byte_level_token_bytes(self.tokenizer.backend.id_to_token(token_id) or "")
            if raw is None:  # special tokens, or a tokenizer that is not byte-level
                raw = self.tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")
            self._token_bytes[token_id] = raw
        return raw

    def token_text(self, token_id: int) -> str:
        return text_of_bytes(self.token_bytes(token_id))

    # ---- validation (runs in a worker thread: JSON, tokenising and templating can be slow) -------

    def _check_model(self, req: _Common) -> None:
        if req.model is not None and req.model != self.model_name:
            raise APIError(f"The model `{req.model}` does not exist.", 404, "NotFoundError", "model", "model_not_found")

    def _encode(self, text: str, add_bos: bool = True, param: str = "prompt") -> list[int]:
        limit = self.max_model_len
        if len(text) > limit * self._max_token_chars:
            raise APIError(
                f"This model's maximum context length is {limit} tokens. However, your prompt has at least "
                f"{len(text) // self._max_token_chars} tokens ({len(text)} characters).",
                param=param,
                code="context_length_exceeded",
            )
        return self.tokenizer.encode(text, add_bos=add_bos)

    def _prompts(self, req: CompletionRequest) -> list[list[int]]:
        p = req.prompt
        if p == "" or (isinstance(p, list) and any(x == "" or x == [] for x in p)):
            raise APIError("prompt must not be empty", param="prompt")
        if isinstance(p, str):
            prompts = [self._encode(p)]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [list(p)]
        elif p and all(isinstance(x, str) for x in p):
            prompts = [self._encode(x) for x in p]
        elif p and all(isinstance(x, list) for x in p):
            prompts = [list(x) for x in p]
        else:
            raise APIError("prompt must be a non-empty string, list of token ids, or list of those", param="prompt")
        for ids in prompts:
            if not ids:
                raise APIError("prompt must not be empty", param="prompt")
            bad = [t for t in ids if not (0 <= t < self.vocab)]
            if bad:
                raise APIError(f"token id {bad[0]} is out of range [0, {self.vocab})", param="prompt")
        return prompts

    def _params(self, req: _Common, prompt_len: int, default_max: Optional[int]) -> SamplingParams:
        limit = self.max_model_len
        if prompt_len >= limit:
            raise APIError(
                f"This model's maximum context length is {limit} tokens. However, your prompt has "
                f"{prompt_len} tokens, leaving no room for a completion.",
                param="prompt",
                code="context_length_exceeded",
            )
        params = req.sampling_params(default_max if default_max is not None else limit - prompt_len, self.vocab)
        if prompt_len + params.max_tokens > limit:
            raise APIError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + params.max_tokens} tokens ({prompt_len} in the prompt, {params.max_tokens} "
                f"in the completion). Please reduce the prompt or max_tokens.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return params

    def _continuation(self, req: _Common, params: SamplingParams, headers: Mapping[str, str]) -> list[int]:
        """The answer so far of a request the router migrated here (empty for any other)."""
        ids = req.continuation_token_ids
        if not ids:
            return []
        if req.candidates > 1:
            raise APIError(
                "continuation_token_ids continues one sequence: n and best_of must be 1", param="continuation_token_ids"
            )
        if self.args.pd_secret and not token_matches(headers, self.args.pd_secret):
            raise APIError(
                "continuation_token_ids needs the PD secret: it is the router's, for migrated requests",
                401,
                "authentication_error",
                param="continuation_token_ids",
            )
        bad = [t for t in ids if not (0 <= t < self.vocab)]
        if bad:
            raise APIError(f"token id {bad[0]} is out of range [0, {self.vocab})", param="continuation_token_ids")
        if len(ids) >= params.max_tokens:
            raise APIError(
                f"continuation_token_ids holds {len(ids)} tokens: nothing is left of max_tokens ({params.max_tokens})",
                param="continuation_token_ids",
            )
        return list(ids)

    def _seq(
        self, req: _Common, ids: list[int], params: SamplingParams, rid: str, headers: Mapping[str, str], index: int = 0
    ) -> EngineRequest:
        seq = EngineRequest(rid=rid, prompt_ids=ids, params=params, output_ids=self._continuation(req, params, headers))
        if self.args.role != "mono":
            from dsv4_engine.pd import bootstrap_target

            info = bootstrap_target(
                req.bootstrap_host,
                req.bootstrap_port,
                req.bootstrap_room,
                role=self.args.role,
                secret_set=bool(self.args.pd_secret),
                authorized=token_matches(headers, self.args.pd_secret),
            )
            seq.pd = (info.bootstrap_host, info.bootstrap_port, choice_room(info.room, index))
            seq.prefill_only = self.args.role == "prefill"
        return seq

    def _choices(
        self,
        req: _Common,
        prompts: list[list[int]],
        params: list[SamplingParams],
        base: str,
        headers: Mapping[str, str],
    ) -> list[EngineRequest]:
        """One engine request per prompt and choice (best_of candidates, else n), prompt-major:
        sequence i * k + j is prompt i's choice j. Choice j samples with seed + j (vLLM); choices
        after the first reuse its prompt pages (`share_prefix_of`). Candidates to rank (best_of > n)
        keep their sampled tokens' logprobs (`logprobs` 0), shown only if the request asked."""
        k = req.candidates
        seqs: list[EngineRequest] = []
        session, ttl = session_of(req.prompt_cache_key, req.session_ttl, headers)
        for i, (ids, p) in enumerate(zip(prompts, params)):
            p = with_session(p, session, ttl)
            if k > req.n and p.logprobs is None:
                p = replace(p, logprobs=0)
            for j in range(k):
                index = i * k + j
                seq = self._seq(
                    req,
                    ids,
                    p if j == 0 else replace(p, seed=choice_seed(p.seed, j)),
                    base if len(prompts) * k == 1 else f"{base}-{index}",
                    headers,
                    index,
                )
                if j:
                    seq.share_prefix_of = seqs[i * k].rid
                seqs.append(seq)
        return seqs

    def prepare_completion(self, body: bytes, headers: Mapping[str, str]) -> Prepared:
        req = parse_request(CompletionRequest, body)
        self._check_model(req)
        prompts = self._prompts(req)
        if req.continuation_token_ids and len(prompts) > 1:
            raise APIError("continuation_token_ids continues one prompt, not a list", param="continuation_token_ids")
        params = [self._params(req, len(ids), 16) for ids in prompts]
        base = req.rid or f"cmpl-{uuid.uuid4().hex}"
        return Prepared(req, self._choices(req, prompts, params, base, headers), base, chat=False)

    def prepare_chat(self, body: bytes, headers: Mapping[str, str]) -> Prepared:
        req = parse_request(ChatCompletionRequest, body)
        self._check_model(req)
        setup = self.chat_setup
        tools = chat_tools(req)
        rendered, plain = render_chat(setup, self.tokenizer, req, self.max_model_len, self._max_token_chars)
        ids, fallback = self._chat_ids(rendered.pieces, req.cache_salt, plain)
        params = self._params(req, max(len(ids), len(fallback or ())), None)
        reasoning = None
        if setup.reasoning_parser is not None:
            reasoning = rendered.thinking or setup.reasoning_parser == "deepseek_r1"
        choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedToolChoice) else req.tool_choice
        spec = tool_choice_spec(
            setup.tool_parser,
            tools,
            choice,
            req.parallel_tool_calls is not False,
            bool(reasoning),
            req.constraint_fields(),
            not self.args.disable_auto_tool_grammar,
        )
        if spec is not None:
            params = replace(params, structured=spec)
        rid = req.rid or f"chatcmpl-{uuid.uuid4().hex}"
        seqs = self._choices(req, [ids], [params], rid, headers)
        for s in seqs:
            s.plain_prompt_ids = fallback
        parser = tool_parser(setup.tool_parser) if tools and setup.tool_parser else None
        # one output parser per sequence: each keeps its own streaming state
        outputs = [ChatOutput(parser, reasoning, req.parallel_tool_calls is not False) for _ in seqs]
        return Prepared(req, seqs, rid, chat=True, outputs=outputs)

    def count_chat_tokens(self, body: bytes) -> int:
        """A chat body's prompt tokens, rendered and tokenized as prepare_chat renders them
        (Anthropic's count_tokens); the same 400s and 404 as a real request."""
        req = parse_request(ChatCompletionRequest, body)
        self._check_model(req)
        return len(render_chat(self.chat_setup, self.tokenizer, req, self.max_model_len, self._max_token_chars)[1])

    def _chat_ids(self, pieces, salt: Optional[str], plain: list[int]) -> tuple[list[int], Optional[list[int]]]:
        """A rendered chat prompt's ids (`plain`: as tokenized), with the answers this engine
        generated spliced in as their generated ids (chat/answer_memo.py); and, on a PD decode that
        spliced some, the plain ids, which decode uses when prefill (no memo) computes the request."""
        if self.answers is None:
            return plain, None
        ids, spliced = encode_with_answers(
            pieces,
            self.tokenizer.encode_pieces,
            self.tokenizer.added_tokens,
            lambda text: self.answers.lookup(salt, text),
        )
        if not spliced:
            return plain, None
        self.answers.spliced += spliced
        return ids, (plain if self.args.role == "decode" else None)

    def _remember_answer(self, req, message: dict, token_ids: list[int], emitted: str, finish: str) -> None:
        """A finished chat answer whose content is all the text it emitted (chat/answer_memo.py)."""
        if self.answers is None or message.get("tool_calls") or message.get("reasoning_content"):
            return
        content = message.get("content")
        if isinstance(content, str):
            self.answers.remember(req.cache_salt, content, token_ids, emitted, self.tokenizer.eos_ids, finish)

    def _reasoning_tokens(self, out: Optional[ChatOutput], token_ids: list[int], reasoning_seen: bool) -> Optional[int]:
        if out is None or out.reasoning is None:
            return None
        return reasoning_tokens(token_ids, self._think_end_id, reasoning_seen)

    # ---- serving -------------------------------------------------------------------------------

    def _processor(self, seq: EngineRequest) -> OutputProcessor:
        # PD prefill shows no text (decode judges every stop): its outputs pass through.
        processor = OutputProcessor(None if seq.prefill_only else self.tokenizer, seq.params)
        processor.resume(seq.output_ids)
        return processor

    async def serve(self, prepare, http: Request, body: Optional[bytes] = None) -> Response:
        """`body`: the request's, when it is not the HTTP one (an agent API translated to chat)."""
        held = self.awaiting.enter()  # from arrival: tokenising counts (the core has nothing yet)
        try:
            return await self._serve(prepare, http, held, body)
        except BaseException:
            held.release()
            raise

    async def _serve(self, prepare, http: Request, held: Held, body: Optional[bytes]) -> Response:
        body = await http.body() if body is None else body
        p: Prepared = await asyncio.to_thread(prepare, body, http.headers)
        p.held = held
        p.span = self.tracing.start(
            "engine.request",
            headers=http.headers,
            kind="server",
            attributes={
                "dsv4.role": self.args.role,
                "dsv4.rid": p.rid,
                "dsv4.prompt_tokens": len(p.seqs[0].prompt_ids),
                "dsv4.continuation_tokens": len(p.seqs[0].output_ids) or None,
            },
        )
        if p.req.stream:
            events = self._merged(p.seqs, p.span, p.held)
            if self.args.max_queued_requests is not None or any(seq.params.structured is not None for seq in p.seqs):
                # The core compiles the grammar and bounds its queue at admission: a refusal must be
                # the response's status (400, 429), so the headers wait for the first output (it
                # comes with the first token).
                try:
                    events = await self._refusal_first(events, http)
                except APIError:
                    tracing.end(p.span, error="refused")
                    raise
                except _ClientGone:  # before its first output (a PD decode waiting for KV that will not come)
                    tracing.end(p.span, error="client gone")
                    return Response(status_code=499)
            return StreamingResponse(self._stream(p, events), media_type="text/event-stream")
        try:
            return await self._complete(p, http)
        finally:
            tracing.end(p.span)

    async def _refusal_first(
        self, outputs: AsyncIterator[tuple[int, RequestOutput]], http: Request
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """`outputs` again, after raising the error of a request the core refused (4xx) before
        producing anything. A client that leaves before the first output ends the request
        (_ClientGone): no response has started, so nothing else would notice (a PD decode's
        first output waits for its KV, which may never come once the router gave up)."""
        nxt = asyncio.ensure_future(outputs.__anext__())
        gone = asyncio.ensure_future(self._wait_disconnect(http))
        try:
            await asyncio.wait({nxt, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not nxt.done():
            nxt.cancel()
            await asyncio.gather(nxt, return_exceptions=True)
            await outputs.aclose()  # aborts the request in the core
            raise _ClientGone()
        first = nxt.result()
        out = first[1]
        if out.finished and out.finish_reason == "error" and 400 <= out.error_code < 500 and not out.token_ids:
            await outputs.aclose()  # ends (aborts) the other prompts of the request too
            raise _failure(out)

        async def chained():
            yield first
            async for item in outputs:
                yield item

        return chained()

    # The phases of a request on this engine, as child spans: up to its first token, then on.
    FIRST_PHASE = {"mono": "engine.prefill", "prefill": "engine.prefill_and_transfer", "decode": "engine.transfer"}

    async def _traced(self, outs: AsyncIterator[RequestOutput], parent) -> AsyncIterator[RequestOutput]:
        if parent is None:
            async for out in outs:
                yield out
            return
        phase = self.tracing.start(self.FIRST_PHASE[self.args.role], parent=parent)
        first = True
        try:
            async for out in outs:
                if first and (out.token_ids or out.finished):
                    first = False
                    tracing.end(
                        phase, error=out.error if out.finished and out.finish_reason in ("error", "abort") else None
                    )
                    phase = self.tracing.start("engine.decode", parent=parent) if not out.finished else None
                if out.finished:
                    tracing.end(
                        phase,
                        error=out.error if out.finish_reason in ("error", "abort") else None,
                        completion_tokens=out.completion_tokens,
                    )
                    phase = None
                yield out
        finally:
            tracing.end(phase, error="ended early")

    async def _merged(
        self, seqs: list[EngineRequest], span=None, held: Optional[Held] = None
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of several requests as they come, tagged with the request's index. `held`
        is released at the first output (or the end)."""
        try:
            async for item in self._merged_outputs(seqs, span):
                if held is not None:
                    held.release()
                yield item
        finally:
            if held is not None:
                held.release()

    async def _merged_outputs(self, seqs: list[EngineRequest], span=None) -> AsyncIterator[tuple[int, RequestOutput]]:
        if len(seqs) == 1:
            outs = self.client.generate(seqs[0], self.lifecycle.closed, self._processor(seqs[0]))
            async for out in self._traced(outs, span):
                yield 0, out
            return
        q: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, seq: EngineRequest) -> None:
            async for out in self.client.generate(seq, self.lifecycle.closed, self._processor(seq)):
                await q.put((i, out))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(seqs)]
        try:
            remaining = len(seqs)
            while remaining:
                i, out = await q.get()
                remaining -= out.finished
                yield i, out
        finally:
            for t in tasks:
                t.cancel()

    async def _collect(self, seqs: list[EngineRequest], span=None, held: Optional[Held] = None) -> list[dict]:
        results = [
            {
                "text": "",
                "token_ids": [],
                "logprobs": [],
                "finish_reason": None,
                "prompt": 0,
                "completion": 0,
                "cached": 0,
            }
            for _ in seqs
        ]
        async for i, out in self._merged(seqs, span, held):
            r = results[i]
            r["text"] += out.text
            r["token_ids"] += out.token_ids
            r["logprobs"] += out.logprobs or []
            if out.finished:
                if out.finish_reason in ("error", "abort"):
                    raise _failure(out)
                r.update(
                    finish_reason=out.finish_reason,
                    prompt=out.prompt_tokens,
                    completion=out.completion_tokens,
                    cached=out.cached_tokens,
                )
        return results

    async def _complete(self, p: Prepared, http: Request) -> Response:
        req, seqs, chat = p.req, p.seqs, p.chat
        work = asyncio.ensure_future(self._collect(seqs, p.span, p.held))
        gone = asyncio.ensure_future(self._wait_disconnect(http))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not work.done():  # client went away: cancelling the generators aborts the requests
            work.cancel()
            return Response(status_code=499)
        results = work.result()
        # The prompt counts once per prompt (its first choice's figures), the completion of every
        # sequence generated (best_of candidates too, as OpenAI bills them).
        k, n = req.candidates, req.n
        prompt_total = sum(r["prompt"] for r in results[::k])
        completion_total = sum(r["completion"] for r in results)
        cached_total = sum(r["cached"] for r in results[::k])
        picked: list[int] = []  # sequence indexes, in choice order: prompt i's choices at i * n ...
        for start in range(0, len(seqs), k):
            group = results[start : start + k]
            best = (
                best_choices([sum(e["logprob"] or 0.0 for e in r["logprobs"]) for r in group], n) if k > n else range(n)
            )
            picked += [start + c for c in best]
        wants_logprobs = req.logprobs_wanted() is not None
        choices = []
        reasoning_total: Optional[int] = None
        for i, s in enumerate(picked):
            r, seq = results[s], seqs[s]
            logprobs = None
            if chat:
                if wants_logprobs:
                    logprobs = chat_logprobs(r["logprobs"], self.token_bytes)
                out = p.outputs[s] if p.outputs else ChatOutput(None, None)
                message = out.message(r["text"])
                # calls returned (also the complete ones before a max_tokens cut): the client must run them
                finish = (
                    "tool_calls" if out.has_calls and r["finish_reason"] in ("stop", "length") else r["finish_reason"]
                )
                c = {"index": i, "message": message, "finish_reason": finish, "logprobs": logprobs}
                self._remember_answer(req, message, r["token_ids"], r["text"], r["finish_reason"])
                thought = self._reasoning_tokens(out, r["token_ids"], bool(message.get("reasoning_content")))
                if thought is not None:
                    reasoning_total = (reasoning_total or 0) + thought
            else:
                text = (self.tokenizer.decode(seq.prompt_ids) if getattr(req, "echo", False) else "") + r["text"]
                if wants_logprobs:
                    logprobs = completion_logprobs(r["logprobs"], self.token_text)
                c = {"index": i, "text": text, "finish_reason": r["finish_reason"], "logprobs": logprobs}
            if req.return_token_ids:
                c["token_ids"] = r["token_ids"]
                c["prompt_token_ids"] = seq.prompt_ids
            choices.append(c)
        usage = _usage(prompt_total, completion_total, cached_total, reasoning_total)
        body = {
            "id": p.rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": usage,
        }
        if req.return_token_ids:
            body["prompt_token_ids"] = seqs[0].prompt_ids
        return JSONResponse(body)

    @staticmethod
    async def _wait_disconnect(http: Request) -> None:
        while not await http.is_disconnected():
            await asyncio.sleep(0.05)

    async def _stream(self, p: Prepared, events=None) -> AsyncIterator[str]:
        try:
            async for event in self._stream_events(p, events):
                yield event
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug must still end the stream the way clients understand
            log.error("stream %s failed:\n%s", p.rid, traceback.format_exc())
            yield _sse(internal_error(p.rid).body())
            yield _sse("[DONE]")
        finally:
            tracing.end(p.span)

    async def _stream_events(self, p: Prepared, events=None) -> AsyncIterator[str]:
        req, chat = p.req, p.chat
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        usage = [0, 0, 0]  # prompt, completion, cached prompt tokens
        # A continuation starts where the engine it left stopped: text offsets past its tokens
        offsets = [
            sum(len(self.token_text(t)) for t in s.output_ids) if s.params.logprobs is not None else 0 for s in p.seqs
        ]
        outputs = p.outputs if chat and p.outputs else [ChatOutput(None, None) for _ in p.seqs]
        generated: list[list[int]] = [[] for _ in p.seqs]
        said: list[dict] = [{} for _ in p.seqs]  # chat: each choice's message so far (content, reasoning, calls)
        emitted = [""] * len(p.seqs)  # chat: each choice's text as the engine emitted it
        reasoning_seen = [False] * len(p.seqs)
        reasoning_total: Optional[int] = None

        def chunk(choices: list, usage_: Optional[dict] = None) -> dict:
            c = {"id": p.rid, "object": obj, "created": created, "model": self.model_name, "choices": choices}
            if usage_ is not None or include_usage:
                c["usage"] = usage_
            return c

        k = req.candidates  # == n: best_of > n is not streamed
        # A choice's role chunk goes out with its first output, so a request that fails before
        # producing anything streams nothing but its error (the router can retry it); a
        # continuation's client has it already.
        sent_role = [not chat or bool(s.output_ids) for s in p.seqs]
        async for i, out in events if events is not None else self._merged(p.seqs, p.span):
            if out.finished and out.finish_reason in ("error", "abort"):
                yield _sse(_failure(out).body())
                yield _sse("[DONE]")
                return
            if not (out.text or out.token_ids or out.finished):
                continue
            if not sent_role[i]:
                sent_role[i] = True
                yield _sse(chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]))
            finish_reason = out.finish_reason if out.finished else None
            c: dict = {"index": i, "finish_reason": finish_reason, "logprobs": None}
            wants_logprobs = p.seqs[i].params.logprobs is not None
            if chat:
                o = outputs[i]
                generated[i] += out.token_ids
                emitted[i] += out.text
                delta = o.feed(out.text) if out.text else {}
                if out.finished:
                    for key, value in o.finish().items():
                        delta[key] = delta.get(key, [] if key == "tool_calls" else "") + value
                    if o.has_calls and finish_reason in ("stop", "length"):
                        c["finish_reason"] = "tool_calls"
                reasoning_seen[i] = reasoning_seen[i] or bool(delta.get("reasoning_content"))
                for key, value in delta.items():
                    said[i][key] = said[i].get(key, [] if key == "tool_calls" else "") + value
                c["delta"] = delta
                if wants_logprobs:
                    c["logprobs"] = chat_logprobs(out.logprobs or [], self.token_bytes)
            else:
                c["text"] = out.text
                if wants_logprobs:
                    c["logprobs"] = completion_logprobs(out.logprobs or [], self.token_text, offsets[i])
                    offsets[i] = next_offset(c["logprobs"], offsets[i])
            if req.return_token_ids:
                c["token_ids"] = out.token_ids
            yield _sse(chunk([c]))
            if out.finished:
                if i % k == 0:  # the prompt counts once, with its first choice
                    usage[0] += out.prompt_tokens
                    usage[2] += out.cached_tokens
                usage[1] += out.completion_tokens
                if chat:
                    if not p.seqs[i].output_ids:  # a continuation's start is not in `generated`
                        self._remember_answer(req, said[i], generated[i], emitted[i], out.finish_reason)
                    thought = self._reasoning_tokens(outputs[i], generated[i], reasoning_seen[i])
                    if thought is not None:
                        reasoning_total = (reasoning_total or 0) + thought
        if include_usage:
            yield _sse(chunk([], _usage(*usage, reasoning_total)))
        yield _sse("[DONE]")
