"""OpenAI-compatible request bodies and errors. Unknown fields are ignored, as vLLM does; fields
we do accept are checked here — type, range, finiteness — before anything reaches the scheduler.

Ranges follow vLLM's (and OpenAI's where vLLM has none): temperature >= 0, top_p in (0, 1],
top_k -1/0 (off) or >= 1, max_tokens >= 1, seed a signed 64-bit integer, logprobs and
top_logprobs 0..20, 1 <= n <= best_of <= MAX_N (best_of > n not streamed, as OpenAI and vLLM),
presence_penalty and frequency_penalty in [-2, 2], repetition_penalty > 0, logit_bias values in
[-100, 100] on ids inside the vocab, 0 <= min_tokens <= max_tokens.
"""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator, model_validator

from dsv4_engine.sampling_params import MAX_LOGIT_BIAS_TOKENS, MAX_LOGPROBS, MAX_PENALTY, SamplingParams
from dsv4_engine.structured import spec as structured
from dsv4_wire.errors import APIError
from dsv4_wire.sequences import MAX_SEQUENCES_PER_REQUEST, too_many_sequences

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_CACHE_SALT_CHARS = 512
# Prompts in one completions request: each becomes a request of its own in the engine, so a
# 16 MiB body of one-token prompts would otherwise be millions of them.
MAX_PROMPTS_PER_REQUEST = 256
ROLES = ("system", "user", "assistant", "tool", "developer")
MAX_N = 16  # most choices (n, or candidates with best_of) one request may ask for


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


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: Optional[str] = Field(None, max_length=256)
    description: Optional[str] = None
    schema_: Optional[Union[dict, bool]] = Field(None, alias="schema")
    strict: Optional[bool] = None  # the schema is always enforced (vLLM does the same)


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: free text, any JSON object, or JSON following a schema."""

    model_config = ConfigDict(extra="ignore")
    type: str
    json_schema: Optional[JSONSchemaFormat] = None

    @field_validator("type")
    @classmethod
    def _type(cls, v):
        if v not in ("text", "json_object", "json_schema"):
            raise ValueError(f"type {v[:64]!r} is not supported (text, json_object or json_schema)")
        return v


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` extra: exactly one constraint."""

    model_config = ConfigDict(extra="ignore")
    json_: Optional[Union[dict, bool, str]] = Field(None, alias="json")
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    structural_tag: Optional[str] = None
    # Knobs that keep their default meaning here (compact JSON, no fallback backend); the others
    # change the language and are refused rather than ignored.
    disable_fallback: Optional[bool] = None
    disable_any_whitespace: Optional[bool] = None
    disable_additional_properties: Optional[bool] = None
    whitespace_pattern: Optional[str] = None


def _spec(make, param: str) -> structured.StructuredSpec:
    """A spec built and cheaply checked; any problem is a 400 naming the request field."""
    try:
        s = make()
        s.check()
        return s
    except ValueError as e:
        raise APIError(f"{param}: {e}", param=param) from None


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
    n: int = Field(1, ge=1, le=MAX_N)
    best_of: Optional[int] = Field(None, ge=1, le=MAX_N)
    presence_penalty: Optional[float] = Field(None, ge=-MAX_PENALTY, le=MAX_PENALTY, allow_inf_nan=False)
    frequency_penalty: Optional[float] = Field(None, ge=-MAX_PENALTY, le=MAX_PENALTY, allow_inf_nan=False)
    repetition_penalty: Optional[float] = Field(None, gt=0, allow_inf_nan=False)
    logit_bias: Optional[dict[str, float]] = Field(None, max_length=MAX_LOGIT_BIAS_TOKENS)
    min_tokens: Optional[int] = Field(None, ge=0, le=INT64_MAX)
    return_token_ids: bool = False
    # Structured outputs (docs/structured-outputs.md): OpenAI's response_format, vLLM's
    # structured_outputs and its older guided_* extras; at most one constraint in all.
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputs] = None
    guided_json: Optional[Union[dict, bool, str]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    guided_decoding_backend: Optional[str] = None
    guided_whitespace_pattern: Optional[str] = None
    # vLLM's prefix-cache isolation: requests with different salts share no cached pages.
    cache_salt: Optional[str] = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    # OpenAI's name for a conversation (also the x-session-id header): its prefix stays pinned for
    # a TTL after each round (dsv4_serve.sessions, dsv4_engine.session_pins); checked there.
    prompt_cache_key: Optional[str] = None
    session_ttl: Optional[Union[float, str]] = None  # or the x-session-ttl header; checked there
    # PD: set by the router on the internal requests it sends to prefill and decode engines.
    bootstrap_host: Optional[str] = Field(None, max_length=256)
    bootstrap_port: Optional[int] = Field(None, ge=0, le=65535)
    bootstrap_room: Optional[int] = Field(None, ge=0, le=INT64_MAX)
    # Logged and used as the response id: a newline in it would forge log lines (issue 39).
    rid: Optional[str] = Field(None, min_length=1, max_length=256, pattern=r"^[A-Za-z0-9._:-]+$")
    # Migration: the router resends a request whose engine failed mid-answer with the tokens it
    # already streamed; this engine continues from there (same PD-secret rule as bootstrap_*).
    continuation_token_ids: Optional[list[StrictInt]] = None

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

    @property
    def candidates(self) -> int:
        """How many sequences are generated per prompt: best_of, else n."""
        return self.best_of or self.n

    def logprobs_wanted(self) -> Optional[int]:
        """How many alternatives per token the request wants (None: no logprobs)."""
        return None

    def constraint_fields(self) -> list[str]:
        """The output-constraint fields the request sets (response_format other than text,
        structured_outputs, guided_*), by name: what `tool_choice` "required" cannot be combined with."""
        names = []
        if self.response_format is not None and self.response_format.type != "text":
            names.append("response_format")
        if self.structured_outputs is not None:
            names.append("structured_outputs")
        names += [
            f
            for f in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
            if getattr(self, f) is not None
        ]
        return names

    def structured_spec(self) -> Optional[structured.StructuredSpec]:
        """The one output constraint the request asks for (None: free text); a 400 naming the
        field for a constraint that is malformed, refused, or given more than once."""
        found: list[tuple[str, structured.StructuredSpec]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", structured.StructuredSpec("json_object")))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise APIError(
                    "response_format.json_schema.schema is required for type json_schema",
                    param="response_format.json_schema.schema",
                )
            found.append(
                (
                    "response_format",
                    _spec(lambda: structured.json_schema(rf.json_schema.schema_), "response_format.json_schema.schema"),
                )
            )
        so = self.structured_outputs
        if so is not None:
            if so.whitespace_pattern is not None:
                raise APIError(
                    "structured_outputs.whitespace_pattern is not supported (JSON is generated compact)",
                    param="structured_outputs.whitespace_pattern",
                )
            if so.disable_additional_properties:
                raise APIError(
                    "structured_outputs.disable_additional_properties is not supported; set "
                    "additionalProperties: false in the schema",
                    param="structured_outputs.disable_additional_properties",
                )
            if so.json_ is not None:
                found.append(
                    (
                        "structured_outputs.json",
                        _spec(lambda: structured.json_schema(so.json_), "structured_outputs.json"),
                    )
                )
            if so.regex is not None:
                found.append(
                    (
                        "structured_outputs.regex",
                        _spec(lambda: structured.StructuredSpec("regex", so.regex), "structured_outputs.regex"),
                    )
                )
            if so.choice is not None:
                found.append(
                    (
                        "structured_outputs.choice",
                        _spec(lambda: structured.choice(so.choice), "structured_outputs.choice"),
                    )
                )
            if so.grammar is not None:
                found.append(
                    (
                        "structured_outputs.grammar",
                        _spec(lambda: structured.StructuredSpec("ebnf", so.grammar), "structured_outputs.grammar"),
                    )
                )
            if so.json_object:
                found.append(("structured_outputs.json_object", structured.StructuredSpec("json_object")))
            if so.structural_tag is not None:
                found.append(
                    (
                        "structured_outputs.structural_tag",
                        _spec(
                            lambda: structured.StructuredSpec("structural_tag", so.structural_tag),
                            "structured_outputs.structural_tag",
                        ),
                    )
                )
        if self.guided_whitespace_pattern is not None:
            raise APIError(
                "guided_whitespace_pattern is not supported (JSON is generated compact)",
                param="guided_whitespace_pattern",
            )
        if self.guided_decoding_backend not in (None, "", "auto", "xgrammar"):
            raise APIError(
                f"guided_decoding_backend {self.guided_decoding_backend[:64]!r} is not served (xgrammar only)",
                param="guided_decoding_backend",
            )
        if self.guided_json is not None:
            found.append(("guided_json", _spec(lambda: structured.json_schema(self.guided_json), "guided_json")))
        if self.guided_regex is not None:
            found.append(
                ("guided_regex", _spec(lambda: structured.StructuredSpec("regex", self.guided_regex), "guided_regex"))
            )
        if self.guided_choice is not None:
            found.append(("guided_choice", _spec(lambda: structured.choice(self.guided_choice), "guided_choice")))
        if self.guided_grammar is not None:
            found.append(
                (
                    "guided_grammar",
                    _spec(lambda: structured.StructuredSpec("ebnf", self.guided_grammar), "guided_grammar"),
                )
            )
        if len(found) > 1:
            raise APIError(
                f"only one output constraint per request; got {', '.join(name for name, _ in found)}", param=found[1][0]
            )
        return found[0][1] if found else None

    def sampling_params(self, default_max_tokens: int, vocab_size: Optional[int] = None) -> SamplingParams:
        if self.best_of is not None and self.best_of < self.n:
            raise APIError(f"best_of ({self.best_of}) must be at least n ({self.n})", param="best_of")
        if self.stream and self.candidates > self.n:  # the best are known only once every candidate ended
            raise APIError("best_of greater than n cannot be streamed", param="best_of")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        stop_ids = list(self.stop_token_ids or [])
        if vocab_size is not None:
            bad = [t for t in stop_ids if not (0 <= t < vocab_size)]
            if bad:
                raise APIError(
                    f"stop_token_ids: token id {bad[0]} is out of range [0, {vocab_size})", param="stop_token_ids"
                )
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
            structured=self.structured_spec(),
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
    def _sequence_count(self):
        prompts = (
            len(self.prompt)
            if isinstance(self.prompt, list) and self.prompt and not isinstance(self.prompt[0], int)
            else 1
        )
        if prompts * self.candidates > MAX_SEQUENCES_PER_REQUEST:
            raise ValueError(too_many_sequences(prompts * self.candidates))
        return self

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


MAX_TOOLS = 512
MAX_NAME_CHARS = 256


def _check_name(name: str, what: str) -> str:
    # DSML writes names inside an XML-like attribute: quotes, angle brackets and newlines would break it
    if not name or len(name) > MAX_NAME_CHARS or any(ch in name for ch in '"<>\r\n'):
        raise ValueError(f"{what} must be 1..{MAX_NAME_CHARS} characters without quotes, angle brackets or newlines")
    return name


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    description: Optional[str] = None
    parameters: Optional[dict] = None
    strict: Optional[bool] = None

    @field_validator("name")
    @classmethod
    def _name(cls, v):
        return _check_name(v, "a function name")


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = "function"
    function: FunctionDef


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str = "{}"

    @field_validator("name")
    @classmethod
    def _name(cls, v):
        return _check_name(v, "a tool call's function name")


class ToolCallIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: Optional[str] = Field(None, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal[ROLES]  # type: ignore[valid-type]
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCallIn]] = None  # assistant: the calls it made
    tool_call_id: Optional[str] = Field(None, max_length=256)  # tool: the call this result answers
    reasoning_content: Optional[str] = None  # assistant: its reasoning (re-rendered where the format keeps it)

    @model_validator(mode="after")
    def _content(self):
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs `content` (a string or a list of text parts)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry `tool_calls`")
        return self

    def as_dict(self) -> dict:
        """The message as the chat renderers take it (content parts joined)."""
        d: dict = {"role": self.role, "content": None if self.content is None else self.text()}
        if self.tool_calls:
            d["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": c.function.arguments},
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            d["reasoning_content"] = self.reasoning_content
        return d

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
    tools: Optional[list[ToolDef]] = Field(None, max_length=MAX_TOOLS)
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: Optional[bool] = None
    chat_template_kwargs: Optional[dict] = None
    reasoning_effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]] = None

    @model_validator(mode="after")
    def _tool_choice(self):
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice: no tool named {choice.function.name!r} in `tools`")
        if choice == "required" and not names:
            raise ValueError('tool_choice: "required" needs `tools`')
        prev = None
        for i, m in enumerate(self.messages):
            if m.role == "tool" and not (prev is not None and (prev.role == "tool" or prev.tool_calls)):
                raise ValueError(
                    f"messages.{i}: a tool message must follow an assistant message with `tool_calls` "
                    "(or another tool message)"
                )
            prev = m
        return self

    def thinking(self) -> bool:
        """Thinking mode: chat_template_kwargs' `thinking` / `enable_thinking`, else on when a
        reasoning_effort other than "none" is given (off by default, as SGLang); the tier an effort
        lands on is the checkpoint's (chat/effort.py)."""
        kw = self.chat_template_kwargs or {}
        for key in ("thinking", "enable_thinking"):
            if key in kw:
                return bool(kw[key])
        return self.reasoning_effort not in (None, "none")

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
