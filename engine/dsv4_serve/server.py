"""The engine's HTTP server: the OpenAI API, health/readiness, metrics, live loads and admin.

Two processes: this one (HTTP, validation, tokenising, chat templates) and the engine core
(`engine_core`: scheduler, model, KV pool, PD controllers and the prefill's bootstrap server),
started as its child. Handlers validate everything before a request reaches the core, and talk
to it only through `engine_client.EngineClient` (a socket pair: requests in, one message of
outputs per engine step back, feeding a per-request asyncio queue). /metrics and /v1/loads
are the core's own, fetched over the channel; /debug/stacks shows both processes.
Parsing, chat templating and tokenising run on a worker thread, so /health and /ready answer
while a multi-megabyte prompt is processed. Every error a client sees is an OpenAI error body
(`dsv4_wire.APIError`), in a stream too (an error event, then [DONE]).

Shutdown: SIGTERM (or SIGINT) drains — new generation requests get a 503, /ready says
"draining", running requests get `--shutdown-grace` seconds to finish, the rest are then ended
with an error — and the process exits 0. A second signal cuts the grace short.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
import traceback
import uuid
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, AsyncIterator, Mapping, Optional

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dsv4_engine.engine_args import EngineArgs
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.request_output import RequestOutput
from dsv4_engine.tokenizer import Tokenizer
from dsv4_serve.admin import error_response, require_admin, thread_stacks
from dsv4_serve.detokenize import OutputProcessor
from dsv4_serve.engine_client import EngineClient, EngineGone, EngineRefused, EngineRequest, EngineStartError, call_soon
from dsv4_serve.gate import DEFAULT_MAX_REQUEST_BYTES, Gate, Lifecycle
from dsv4_serve.logprobs import byte_level_token_bytes, chat_logprobs, completion_logprobs, next_offset, text_of_bytes
from dsv4_serve.protocol import ChatCompletionRequest, CompletionRequest, _Common, parse_request
from dsv4_wire import APIError, Paths, token_matches

if TYPE_CHECKING:
    from dsv4_engine.engine import Engine

log = logging.getLogger("dsv4.server")
CORE_ANSWER_TIMEOUT = 10.0  # seconds the core's reader may take to answer a health or admin question
# After the engine core died: /health says so and in-flight requests get their error for this
# long, then the HTTP process exits 1 so that its supervisor (kubelet, `dsv4 up`) restarts both.
DEAD_CORE_EXIT_DELAY = 5.0


@dataclass
class ServerArgs(EngineArgs):
    """Everything `dsv4 serve` takes: the engine's arguments plus the server's and PD's."""

    host: str = "127.0.0.1"
    port: int = 8100
    advertise_host: Optional[str] = None  # PD: the address peers reach this engine at (default: see advertised_url)
    bootstrap_port: int = 9100
    bootstrap_timeout: float = 30.0
    transfer_timeout: float = 30.0
    waiting_timeout: float = 60.0
    deadlines: bool = True
    enable_fault_injection: bool = False
    admin_token: Optional[str] = None
    pd_secret: Optional[str] = None  # engine-to-engine PD endpoints require it when set
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    shutdown_grace: float = 30.0  # seconds running requests get to finish after SIGTERM
    transfer_checksum: bool = False  # PD: checksum every state region of a hand-off (decode verifies)

    def engine_args(self) -> EngineArgs:
        return EngineArgs(**{f.name: getattr(self, f.name) for f in fields(EngineArgs)})


def _usage(prompt: int, completion: int, cached: int = 0) -> dict:
    """OpenAI usage; `cached`: prompt tokens the prefix cache served (OpenAI's and vLLM's
    prompt_tokens_details.cached_tokens)."""
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, allow_nan=False)}\n\n"


def _failure(out: RequestOutput) -> APIError:
    """The client-facing error of a request the engine ended with an error or abort."""
    code = out.error_code if out.error_code >= 400 else 500
    return APIError(out.error or "request failed", code, "server_error" if code >= 500 else "invalid_request_error")


@dataclass
class Prepared:
    """A request validated and tokenised (off the event loop), ready for the engine."""

    req: _Common
    seqs: list[EngineRequest]
    rid: str
    chat: bool


class OpenAIServing:
    def __init__(self, client: EngineClient, tokenizer: Tokenizer, args: ServerArgs, lifecycle: Optional[Lifecycle] = None):
        self.client = client
        self.tokenizer = tokenizer
        self.lifecycle = lifecycle or Lifecycle()
        self.args = args
        self.model_name = args.served_model_name
        self.vocab = client.vocab_size
        self.max_model_len = client.max_model_len
        self._token_bytes: dict[int, bytes] = {}
        from tokenizers import decoders

        self._byte_level = isinstance(getattr(tokenizer.backend, "decoder", None), decoders.ByteLevel)
        # No token spells more characters than its longest vocabulary entry: a text longer than
        # that times the context cannot fit, and is refused without spending seconds tokenising it.
        self._max_token_chars = max(len(k) for k in tokenizer.backend.get_vocab(with_added_tokens=True))

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
                f"{len(text) // self._max_token_chars} tokens ({len(text)} characters).", param=param,
                code="context_length_exceeded")
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
                f"{prompt_len} tokens, leaving no room for a completion.", param="prompt", code="context_length_exceeded")
        params = req.sampling_params(default_max if default_max is not None else limit - prompt_len, self.vocab)
        if prompt_len + params.max_tokens > limit:
            raise APIError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + params.max_tokens} tokens ({prompt_len} in the prompt, {params.max_tokens} "
                f"in the completion). Please reduce the prompt or max_tokens.", param="max_tokens",
                code="context_length_exceeded")
        return params

    def _seq(self, req: _Common, ids: list[int], params: SamplingParams, rid: str, headers: Mapping[str, str]) -> EngineRequest:
        seq = EngineRequest(rid=rid, prompt_ids=ids, params=params)
        if self.args.role != "mono":
            from dsv4_engine.pd import bootstrap_target

            info = bootstrap_target(req.bootstrap_host, req.bootstrap_port, req.bootstrap_room, role=self.args.role,
                                    secret_set=bool(self.args.pd_secret), authorized=token_matches(headers, self.args.pd_secret))
            seq.pd = (info.bootstrap_host, info.bootstrap_port, info.room)
            seq.prefill_only = self.args.role == "prefill"
        return seq

    def prepare_completion(self, body: bytes, headers: Mapping[str, str]) -> Prepared:
        req = parse_request(CompletionRequest, body)
        self._check_model(req)
        prompts = self._prompts(req)
        if len(prompts) > 1 and self.args.role != "mono":
            # One bootstrap room names one hand-off: several prompts would share it on both sides.
            raise APIError("a list of prompts is served by monolithic engines only; send one prompt per request "
                           "through the PD router", param="prompt")
        params = [self._params(req, len(ids), 16) for ids in prompts]
        base = req.rid or f"cmpl-{uuid.uuid4().hex}"
        seqs = [self._seq(req, ids, p, base if len(prompts) == 1 else f"{base}-{i}", headers)
                for i, (ids, p) in enumerate(zip(prompts, params))]
        return Prepared(req, seqs, base, chat=False)

    def prepare_chat(self, body: bytes, headers: Mapping[str, str]) -> Prepared:
        req = parse_request(ChatCompletionRequest, body)
        self._check_model(req)
        msgs = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            text = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=req.add_generation_prompt)
        except Exception as e:  # the template refused these messages (roles, order, ...)
            raise APIError(f"messages could not be rendered by the chat template: {e}", param="messages") from None
        ids = self._encode(text, add_bos=False, param="messages")
        if not ids:
            raise APIError("the rendered chat prompt is empty", param="messages")
        params = self._params(req, len(ids), None)
        rid = req.rid or f"chatcmpl-{uuid.uuid4().hex}"
        return Prepared(req, [self._seq(req, ids, params, rid, headers)], rid, chat=True)

    # ---- serving -------------------------------------------------------------------------------

    def _processor(self, seq: EngineRequest) -> OutputProcessor:
        # PD prefill shows no text (decode judges every stop): its outputs pass through.
        return OutputProcessor(None if seq.prefill_only else self.tokenizer, seq.params)

    async def serve(self, prepare, http: Request) -> Response:
        body = await http.body()
        p: Prepared = await asyncio.to_thread(prepare, body, http.headers)
        if p.req.stream:
            return StreamingResponse(self._stream(p), media_type="text/event-stream")
        return await self._complete(p, http)

    async def _merged(self, seqs: list[EngineRequest]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of several requests as they come, tagged with the request's index."""
        if len(seqs) == 1:
            async for out in self.client.generate(seqs[0], self.lifecycle.closed, self._processor(seqs[0])):
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

    async def _collect(self, seqs: list[EngineRequest]) -> list[dict]:
        results = [{"text": "", "token_ids": [], "logprobs": [], "finish_reason": None, "prompt": 0, "completion": 0,
                    "cached": 0} for _ in seqs]
        async for i, out in self._merged(seqs):
            r = results[i]
            r["text"] += out.text
            r["token_ids"] += out.token_ids
            r["logprobs"] += out.logprobs or []
            if out.finished:
                if out.finish_reason in ("error", "abort"):
                    raise _failure(out)
                r.update(finish_reason=out.finish_reason, prompt=out.prompt_tokens, completion=out.completion_tokens,
                         cached=out.cached_tokens)
        return results

    async def _complete(self, p: Prepared, http: Request) -> Response:
        req, seqs, chat = p.req, p.seqs, p.chat
        work = asyncio.ensure_future(self._collect(seqs))
        gone = asyncio.ensure_future(self._wait_disconnect(http))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not work.done():  # client went away: cancelling the generators aborts the requests
            work.cancel()
            return Response(status_code=499)
        results = work.result()
        usage = _usage(sum(r["prompt"] for r in results), sum(r["completion"] for r in results),
                       sum(r["cached"] for r in results))
        choices = []
        for i, (r, seq) in enumerate(zip(results, seqs)):
            logprobs = None
            if chat:
                if seq.params.logprobs is not None:
                    logprobs = chat_logprobs(r["logprobs"], self.token_bytes)
                c = {"index": i, "message": {"role": "assistant", "content": r["text"]}, "finish_reason": r["finish_reason"],
                     "logprobs": logprobs}
            else:
                text = (self.tokenizer.decode(seq.prompt_ids) if getattr(req, "echo", False) else "") + r["text"]
                if seq.params.logprobs is not None:
                    logprobs = completion_logprobs(r["logprobs"], self.token_text)
                c = {"index": i, "text": text, "finish_reason": r["finish_reason"], "logprobs": logprobs}
            if req.return_token_ids:
                c["token_ids"] = r["token_ids"]
                c["prompt_token_ids"] = seq.prompt_ids
            choices.append(c)
        body = {"id": p.rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices, "usage": usage}
        if req.return_token_ids:
            body["prompt_token_ids"] = seqs[0].prompt_ids
        return JSONResponse(body)

    @staticmethod
    async def _wait_disconnect(http: Request) -> None:
        while not await http.is_disconnected():
            await asyncio.sleep(0.05)

    async def _stream(self, p: Prepared) -> AsyncIterator[str]:
        try:
            async for event in self._stream_events(p):
                yield event
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug must still end the stream the way clients understand
            log.error("stream %s failed:\n%s", p.rid, traceback.format_exc())
            yield _sse(APIError(f"internal error: {e}", 500, "server_error").body())
            yield _sse("[DONE]")

    async def _stream_events(self, p: Prepared) -> AsyncIterator[str]:
        req, chat = p.req, p.chat
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        usage = [0, 0, 0]  # prompt, completion, cached prompt tokens
        offsets = [0] * len(p.seqs)

        def chunk(choices: list, usage_: Optional[dict] = None) -> dict:
            c = {"id": p.rid, "object": obj, "created": created, "model": self.model_name, "choices": choices}
            if usage_ is not None or include_usage:
                c["usage"] = usage_
            return c

        sent_role = not chat  # the role chunk goes out with the first output, so a request that
        # fails before producing anything streams nothing but its error (the router can retry it)
        async for i, out in self._merged(p.seqs):
            if out.finished and out.finish_reason in ("error", "abort"):
                yield _sse(_failure(out).body())
                yield _sse("[DONE]")
                return
            if not (out.text or out.token_ids or out.finished):
                continue
            if not sent_role:
                sent_role = True
                yield _sse(chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]))
            c: dict = {"index": i, "finish_reason": out.finish_reason if out.finished else None, "logprobs": None}
            wants_logprobs = p.seqs[i].params.logprobs is not None
            if chat:
                c["delta"] = {"content": out.text} if out.text else {}
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
                usage[0] += out.prompt_tokens
                usage[1] += out.completion_tokens
                usage[2] += out.cached_tokens
        if include_usage:
            yield _sse(chunk([], _usage(*usage)))
        yield _sse("[DONE]")


def build_app(client: EngineClient, tokenizer: Tokenizer, args: ServerArgs, lifecycle: Optional[Lifecycle] = None) -> FastAPI:
    app = FastAPI(title="dsv4 engine", docs_url=None, redoc_url=None, openapi_url=None)
    lifecycle = lifecycle or Lifecycle()
    serving = OpenAIServing(client, tokenizer, args, lifecycle)
    app.state.client = client
    app.state.serving = serving
    app.add_middleware(Gate, lifecycle=lifecycle, max_request_bytes=args.max_request_bytes)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        msg = f"{loc}: {first.get('msg', 'invalid request')}" if loc else first.get("msg", "invalid request")
        return error_response(APIError(msg, 400, param=loc or None))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(http: Request, e: StarletteHTTPException):
        if e.status_code == 404:
            msg = f"Invalid URL ({http.method} {http.url.path})"
        elif e.status_code == 405:
            msg = f"Method {http.method} is not allowed on {http.url.path}"
        else:
            msg = str(e.detail)
        return error_response(APIError(msg, e.status_code, "invalid_request_error" if e.status_code < 500 else "server_error"))

    @app.exception_handler(Exception)
    async def _unexpected(http: Request, e: Exception):
        log.error("%s %s failed:\n%s", http.method, http.url.path, traceback.format_exc())
        return error_response(APIError(f"internal error: {type(e).__name__}: {e}", 500, "server_error"))

    @app.post(Paths.COMPLETIONS)
    async def completions(http: Request):
        return await serving.serve(serving.prepare_completion, http)

    @app.post(Paths.CHAT_COMPLETIONS)
    async def chat(http: Request):
        return await serving.serve(serving.prepare_chat, http)

    @app.get(Paths.MODELS)
    async def models():
        return {"object": "list", "data": [{"id": serving.model_name, "object": "model", "created": 0,
                                            "owned_by": "dsv4", "max_model_len": client.max_model_len}]}

    async def core_state() -> tuple[Optional[dict], str]:
        """The core's loop state, or None and why there is none (process gone, not answering)."""
        if not client.alive:
            return None, client.dead or "engine process exited"
        try:
            return await client.ask("state", timeout=CORE_ANSWER_TIMEOUT), ""
        except EngineGone as e:
            return None, str(e)
        except asyncio.TimeoutError:
            return None, f"engine process not answering for {CORE_ANSWER_TIMEOUT:.0f}s"

    @app.get(Paths.HEALTH)
    async def health():
        state, why = await core_state()
        if state is None:
            return JSONResponse({"status": why}, status_code=503)
        if not state["alive"]:
            return JSONResponse({"status": "engine loop stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get(Paths.READY)
    async def ready():
        state, why = await core_state()
        if state is None:
            return JSONResponse({"ready": False, "reason": why}, status_code=503)
        if not state["alive"] or state["stalled"] > 10:
            return JSONResponse({"ready": False, "reason": f"engine loop not progressing ({state['stalled']:.1f}s)"},
                                status_code=503)
        if state["draining"] or lifecycle.draining:
            return JSONResponse({"ready": False, "reason": "draining"}, status_code=503)
        return {"ready": True}

    async def from_core(name: str):
        try:
            return await client.ask(name, timeout=CORE_ANSWER_TIMEOUT)
        except (EngineGone, asyncio.TimeoutError) as e:
            raise APIError(f"engine process unavailable: {str(e) or 'no answer'}", 503, "server_error") from None

    @app.get(Paths.METRICS)
    async def metrics():
        # The core's registry, rendered there: one scrape, one round trip, the same text as ever.
        return Response(await from_core("metrics"), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get(Paths.SERVER_INFO)
    async def server_info():
        return {"role": args.role, "model": serving.model_name, "bootstrap_port": args.bootstrap_port if args.role == "prefill" else None,
                "boot_id": client.info["boot_id"], "max_model_len": client.max_model_len, "page_size": client.info["page_size"],
                "kernel_backend": client.info["kernel_backend"], "pid": os.getpid(), "engine_pid": client.pid}

    @app.get(Paths.LOADS)
    async def loads():
        return await from_core("loads")

    @app.post(Paths.ADMIN_DRAIN)
    async def drain(http: Request):
        require_admin(http, args.admin_token)
        await from_core("drain")
        return {"draining": True}

    @app.post(Paths.ADMIN_ABORT)
    async def abort(http: Request):
        require_admin(http, args.admin_token)
        try:
            body = await http.json()
        except Exception:
            raise APIError("body must be JSON: {\"rid\": ...} or {\"all\": true}")
        if not isinstance(body, dict) or not (body.get("all") is True or isinstance(body.get("rid"), str)):
            raise APIError("give {\"rid\": \"...\"} or {\"all\": true}")
        try:
            client.abort(body.get("rid"), reason=str(body.get("reason", "aborted by admin")), all_=body.get("all") is True)
        except EngineGone as e:
            raise APIError(f"engine process unavailable: {e}", 503, "server_error") from None
        return {"aborted": body.get("rid") or "all"}

    @app.get(Paths.DEBUG_STACKS)
    async def stacks(http: Request):
        require_admin(http, args.admin_token)
        try:
            core = await client.ask("stacks", timeout=CORE_ANSWER_TIMEOUT)
        except (EngineGone, asyncio.TimeoutError) as e:
            core = f"(no answer: {str(e) or 'timed out'})\n"
        return PlainTextResponse(f"=== HTTP process (pid {os.getpid()}) ===\n{thread_stacks()}\n"
                                 f"=== engine core process (pid {client.pid}) ===\n{core}")

    return app


def make_engine(args: ServerArgs) -> Engine:
    """The engine itself: the core process builds it (this process never imports torch)."""
    from dsv4_engine.engine import Engine

    engine = Engine(args.engine_args())
    if args.role != "mono":
        from dsv4_engine.pd import attach_role

        attach_role(engine, args)
    return engine


class _Server(uvicorn.Server):
    """uvicorn without its own SIGTERM/SIGINT handling: `run_server` drains first."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


async def drain(client: EngineClient, lifecycle: Lifecycle, grace: float, hurry: asyncio.Event) -> None:
    """Stop taking requests, let running ones finish for up to `grace` seconds (or until `hurry`
    is set by a second signal), then end the rest with an error and wait for their answers."""
    lifecycle.draining = True
    start = time.monotonic()

    async def core_busy() -> bool:
        try:
            return (await client.ask("state", timeout=CORE_ANSWER_TIMEOUT))["seqs"] > 0
        except (EngineGone, asyncio.TimeoutError):
            return False  # a core that is gone or mute has nothing left to finish

    async def busy() -> bool:
        return lifecycle.active > 0 or await core_busy()

    try:
        await client.ask("drain", timeout=CORE_ANSWER_TIMEOUT)
    except (EngineGone, asyncio.TimeoutError):
        pass
    log.warning("draining: %d request(s) running, up to %.1fs to finish", lifecycle.active, grace)
    while await busy() and time.monotonic() - start < grace and not hurry.is_set():
        await asyncio.sleep(0.05)
    if await busy():
        log.warning("drain grace over: ending %d running request(s) with an error", lifecycle.active)
        lifecycle.closed = True
        try:
            client.abort(reason="server shutting down", all_=True)
        except EngineGone:
            pass
        end = time.monotonic() + 5.0
        while lifecycle.active > 0 and time.monotonic() < end:
            await asyncio.sleep(0.02)
    log.warning("drained in %.1fs", time.monotonic() - start)


def run_server(args: ServerArgs, spawned=None) -> None:
    """Serve until SIGTERM/SIGINT; `spawned`: a `core_spawn.spawn_core()` started earlier."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        client = EngineClient.start(args, spawned)  # the engine core process: model, KV pool, PD, bootstrap
    except EngineRefused as e:  # as the CLI refuses any bad flag: one line, exit 2
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    except EngineStartError as e:
        print(f"dsv4 serve: the engine could not start: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    try:
        _serve_http(client, args)
    finally:
        died = client.dead is not None
        client.shutdown()
    if died:
        sys.exit(1)


def _serve_http(client: EngineClient, args: ServerArgs) -> None:
    lifecycle = Lifecycle()
    app = build_app(client, Tokenizer.from_dir(args.model), args, lifecycle)
    if args.role != "mono":
        from dsv4_serve.pd_routes import extend_app

        extend_app(app, client, args)
    servers = [_Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                      timeout_graceful_shutdown=5))]
    extra = f", bootstrap on port {args.bootstrap_port}" if args.role == "prefill" else ""
    print(f"dsv4 serve: {args.role} engine for {args.served_model_name} on http://{args.host}:{args.port}{extra} "
          f"({client.info['num_pages']} KV pages of {client.info['page_size']} tokens, max_model_len {client.max_model_len}, "
          f"kernels {client.info['kernel_backend']}; engine core pid {client.pid})", flush=True)

    async def serve_all() -> None:
        loop = asyncio.get_running_loop()
        signalled, hurry = asyncio.Event(), asyncio.Event()

        def on_signal() -> None:
            (hurry if signalled.is_set() else signalled).set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal)
        gone = asyncio.Event()
        client.on_gone = lambda: call_soon(loop, gone.set)
        if not client.alive:
            gone.set()
        tasks = [asyncio.create_task(s.serve()) for s in servers]
        waiter = asyncio.create_task(signalled.wait())
        core_waiter = asyncio.create_task(gone.wait())
        done, _ = await asyncio.wait([waiter, core_waiter, *tasks], return_when=asyncio.FIRST_COMPLETED)
        if waiter in done:  # SIGTERM/SIGINT: drain, then let uvicorn close the connections
            await drain(client, lifecycle, args.shutdown_grace, hurry)
        elif core_waiter in done:
            log.error("the engine core process is gone (%s): exiting in %.0fs", client.dead, DEAD_CORE_EXIT_DELAY)
            await asyncio.sleep(DEAD_CORE_EXIT_DELAY)
        waiter.cancel()
        core_waiter.cancel()
        for s in servers:
            s.should_exit = True
        await asyncio.gather(*tasks)

    asyncio.run(serve_all())
