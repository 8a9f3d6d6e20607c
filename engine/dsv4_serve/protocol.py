"""OpenAI-compatible request bodies and errors. Unknown fields are ignored, as vLLM does; fields
we do accept are checked here — type, range, finiteness — before anything reaches the scheduler.

Ranges follow vLLM's (and OpenAI's where vLLM has none): temperature >= 0, top_p in (0, 1],
top_k -1/0 (off) or >= 1, max_tokens >= 1, seed a signed 64-bit integer, logprobs and
top_logprobs 0..20, n = 1 (the only value served), presence_penalty and frequency_penalty in
[-2, 2], repetition_penalty > 0, logit_bias values in [-100, 100] on ids inside the vocab,
0 <= min_tokens <= max_tokens, best_of absent or equal to n (anything else is refused: we do
not generate candidates to pick from).
"""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator, model_validator

from dsv4_engine.sampling_params import MAX_LOGIT_BIAS_TOKENS, MAX_LOGPROBS, MAX_PENALTY, SamplingParams
from dsv4_wire.errors import APIError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_CACHE_SALT_CHARS = 512
# Prompts in one completions request: each becomes a request of its own in the engine, so a
# 16 MiB body of one-token prompts would otherwise be millions of them.
MAX_PROMPTS_PER_REQUEST = 256
ROLES = ("system", "user", "assistant", "tool", "developer")


def _union_branch(part) -> bool:
    """A location part that names a union member's type (str, list[int], function-after[...])."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "none") or "[" in part)


def validation_message(e: ValidationError) -> tuple[str, Optional[str]]:
    """(message, param) for the first error, without echoing the input (it may be huge)."""
    errs = e.errors(include_input=False, include_url=False)
    # A union field fails once per branch ("content.str: Input should be a valid string", then the
    # list branch's real reason): our own validators' words say more than a branch's type error.
    first = next((err for err in errs if err.get("type") == "value_error"), errs[0] if errs else {})
    loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body" and not _union_branch(x))
    msg = str(first.get("msg", "invalid request"))
    msg = msg.removeprefix("Value error, ")
    if loc.split(".")[0] == "prompt" and first.get("type") != "value_error":  # every branch of the union failed
        loc, msg = "prompt", "must be a string, a list of token ids (integers), or a list of either"
    return (f"{loc}: {msg}" if loc else msg), (loc or None)


def parse_request(model: type[BaseModel], body: bytes) -> BaseModel:
    """Parse and validate a JSON body (pydantic's parser: nesting is capped, NaN/Infinity
    literals reach only fields that refuse them); any problem is a 400."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        message, param = validation_message(e)
        raise APIError(message, 400, param=param) from None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: Optional[str] = Field(None, max_length=512)
    max_tokens: Optional[int] = None  # >= 1 and within the context: checked with the prompt
    temperature: Optional[float] = Field(None, ge=0, allow_inf_nan=False)
    top_p: Optional[float] = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: Optional[int] = Field(None, ge=-1, le=INT64_MAX)
    seed: Optional[int] = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: int = 1
    best_of: Optional[int] = None
    presence_penalty: Optional[float] = Field(None, ge=-MAX_PENALTY, le=MAX_PENALTY, allow_inf_nan=False)
    frequency_penalty: Optional[float] = Field(None, ge=-MAX_PENALTY, le=MAX_PENALTY, allow_inf_nan=False)
    repetition_penalty: Optional[float] = Field(None, gt=0, allow_inf_nan=False)
    logit_bias: Optional[dict[str, float]] = Field(None, max_length=MAX_LOGIT_BIAS_TOKENS)
    min_tokens: Optional[int] = Field(None, ge=0, le=INT64_MAX)
    return_token_ids: bool = False
    # vLLM's prefix-cache isolation: requests with different salts share no cached pages.
    cache_salt: Optional[str] = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    # PD: set by the router on the internal requests it sends to prefill and decode engines.
    bootstrap_host: Optional[str] = Field(None, max_length=256)
    bootstrap_port: Optional[int] = Field(None, ge=0, le=65535)
    bootstrap_room: Optional[int] = Field(None, ge=0, le=INT64_MAX)
    rid: Optional[str] = Field(None, min_length=1, max_length=256)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v):
        # OpenAI's keys are token ids written as strings; the values' range is SamplingParams.validate's
        for key in v or {}:
            if not (key.isascii() and key.strip().isdigit()):
                raise ValueError(f"key {key[:32]!r} is not a token id")
        return v

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, v):
        if v is not None and v < 1:
            raise ValueError("max_tokens must be at least 1")
        return v

    @model_validator(mode="after")
    def _stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        return self

    def logprobs_wanted(self) -> Optional[int]:
        """How many alternatives per token the request wants (None: no logprobs)."""
        return None

    def sampling_params(self, default_max_tokens: int, vocab_size: Optional[int] = None) -> SamplingParams:
        if self.n != 1:
            raise APIError("only n=1 is supported", param="n")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(f"best_of={self.best_of} is not supported: only best_of equal to n ({self.n}) is served",
                           param="best_of")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        stop_ids = list(self.stop_token_ids or [])
        if vocab_size is not None:
            bad = [t for t in stop_ids if not (0 <= t < vocab_size)]
            if bad:
                raise APIError(f"stop_token_ids: token id {bad[0]} is out of range [0, {vocab_size})", param="stop_token_ids")
        bias = {int(k): v for k, v in (self.logit_bias or {}).items()}
        if vocab_size is not None:
            bad = sorted(t for t in bias if t >= vocab_size)
            if bad:
                raise APIError(f"logit_bias: token id {bad[0]} is out of range [0, {vocab_size})", param="logit_bias")
        p = SamplingParams(
            max_tokens=self.max_tokens if self.max_tokens is not None else default_max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k in (None, 0) else self.top_k,
            seed=self.seed,
            stop=stop,
            stop_token_ids=stop_ids,
            ignore_eos=self.ignore_eos,
            logprobs=self.logprobs_wanted(),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=bias,
            min_tokens=self.min_tokens or 0,
            cache_salt=self.cache_salt,
        )
        try:
            p.validate()
        except ValueError as e:
            raise APIError(str(e), param=str(e).split(" ")[0].rstrip(":")) from None
        return p


class CompletionRequest(_Common):
    # StrictInt: a JSON true/false/1.0 is not a token id (lax ints would take true as token 1)
    prompt: Union[str, list[StrictInt], list[str], list[list[StrictInt]]]
    echo: bool = False
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)

    @field_validator("prompt")
    @classmethod
    def _prompt_count(cls, v):
        if isinstance(v, list) and v and not isinstance(v[0], int) and len(v) > MAX_PROMPTS_PER_REQUEST:
            raise ValueError(f"at most {MAX_PROMPTS_PER_REQUEST} prompts per request, not {len(v)}")
        return v

    @model_validator(mode="after")
    def _echo_logprobs(self):
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs is not supported (prompt logprobs are not computed)")
        return self

    def logprobs_wanted(self) -> Optional[int]:
        return self.logprobs


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: Optional[str] = None

    @model_validator(mode="after")
    def _text_only(self):
        if self.type != "text":
            raise ValueError(f"only text content parts are supported, not {self.type!r}")
        if self.text is None:
            raise ValueError("a text content part needs a string `text`")
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal[ROLES]  # type: ignore[valid-type]
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None

    @model_validator(mode="after")
    def _content(self):
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs `content` (a string or a list of text parts)")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text or "" for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None
    add_generation_prompt: bool = True
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)

    @field_validator("max_completion_tokens")
    @classmethod
    def _max_completion_tokens(cls, v):
        if v is not None and v < 1:
            raise ValueError("max_completion_tokens must be at least 1")
        return v

    @model_validator(mode="after")
    def _top_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.max_completion_tokens is not None and self.max_tokens is None:
            self.max_tokens = self.max_completion_tokens
        return self

    def logprobs_wanted(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None
