"""OpenAI wire format: request models shared by the worker and the router.

The worker validates requests fully with these models. The router validates with
the same models so that a bad request is answered at the edge (and never retried
across the fleet), and computes the text it routes on with `routing_text`.
A chat or completions request with a top-level field that is neither modelled here
nor a documented OpenAI / vLLM / SGLang field (shared/wire/known_fields.py) is refused,
naming it, as OpenAI's API refuses an unrecognized argument: a typo (`max_token`) must
not be ignored. The documented extensions pass, so clients of stock engines keep
working; nested objects and SGLang's `/generate` stay lenient. Known fields are strict
(no "5" for 5, no 0 for false) and every constraint is expressed in the types, so the
OpenAPI document generated from these models says exactly what validation accepts.
"""

from __future__ import annotations

import difflib
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError, SchemaValidator

from shared.wire.known_fields import KNOWN_EXTRA

UNRECOGNIZED = "unrecognized_argument"  # the error type `validation_error` names
# Per request class, every top-level field it accepts (its own and KNOWN_EXTRA's).
_KNOWN_NAMES: dict[type, frozenset[str]] = {}


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Lenient):
    include_usage: bool = False


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class Message(_Lenient):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


NonEmptyStr = Annotated[str, Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Stop = NonEmptyStr | Annotated[list[NonEmptyStr], Field(max_length=16)] | None
MaxTokens = Annotated[int, Field(ge=1, le=1_000_000)]
TopK = Literal[-1] | Annotated[int, Field(ge=1)]  # -1: no top-k cut
Penalty = Annotated[float, Field(ge=-2, le=2)]  # OpenAI's presence / frequency range
# Token id (as a JSON object key, a string) -> bias added to its logit.
LogitBias = dict[str, Annotated[float, Field(ge=-100, le=100)]]
TopLogprobs = Annotated[int, Field(ge=0, le=20)]  # OpenAI's limit
# OpenAI's `prompt_cache_key` (requests that share a cache say so): at most this many
# UTF-8 bytes (router/holdings/sessions.py keys its session table on it).
MAX_PROMPT_CACHE_KEY_BYTES = 1024
# The key a worker pins a session under, where the router sends it: the tenant's session
# (router/holdings/sessions.py's digest, hex), not the client's text, since two tenants
# may pick one key; without the header a worker pins under `prompt_cache_key` itself.
PIN_KEY_HEADER = "x-radix-pin-key"
# Our extension: hold the answer's prefix in the worker's cache this many seconds after
# it (a pin across a tool gap; worker/engine/pins.py). The worker clamps it to its
# `pin_max_ttl_s` and says so in the answer's usage.
PinTtl = Annotated[float, Field(ge=0, le=86_400)]
# The most choices the schema allows; a worker's `max_n` may be lower (400 from it).
MAX_N = 128


def _known_extras_schema(schema: dict[str, Any], cls: type) -> None:
    """The OpenAPI document says the rule: no field beyond these, and the documented
    extensions (known_fields.py) listed as passed on unchecked."""
    endpoint = getattr(cls, "wire_endpoint", None)
    if endpoint is None:
        return
    props = schema.setdefault("properties", {})
    for name in sorted(KNOWN_EXTRA[endpoint] - props.keys()):
        props[name] = {"description": "a documented OpenAI, vLLM or SGLang field: passed on "
                       "to the worker unchecked (shared/wire/known_fields.py)"}  # fmt: skip
    schema["additionalProperties"] = False


class _Sampling(_Lenient):
    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra=_known_extras_schema)

    model: str | None = None
    max_tokens: MaxTokens | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: TopK = -1
    min_p: float = Field(0.0, ge=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: float = Field(1.0, gt=0, le=2)
    logit_bias: LogitBias | None = None
    seed: int | None = None
    stop: Stop = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's prefix-cache namespace: a salted prompt shares cached blocks only with
    # prompts of the same salt (worker/engine/salt.py). Non-empty, as vLLM requires.
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    prompt_cache_key: str | None = None
    cache_pin_ttl: PinTtl | None = None

    @field_validator("prompt_cache_key")
    @classmethod
    def _key_bound(cls, key: str | None) -> str | None:
        if (
            key is not None
            and len(key.encode("utf-8", "surrogatepass")) > MAX_PROMPT_CACHE_KEY_BYTES
        ):
            raise ValueError(f"longer than {MAX_PROMPT_CACHE_KEY_BYTES} bytes (UTF-8)")
        return key

    wire_endpoint: ClassVar[str]  # "chat" or "completions": which KNOWN_EXTRA applies

    def stop_list(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @model_validator(mode="before")
    @classmethod
    def _refuse_unrecognized(cls, data: Any) -> Any:
        """An unknown top-level field is an error naming it (and the nearest known one)."""
        if isinstance(data, dict):
            known = _KNOWN_NAMES.get(cls)
            if known is None:  # once per class: `model_fields` is a property per read
                known = frozenset(cls.model_fields) | KNOWN_EXTRA[cls.wire_endpoint]
                _KNOWN_NAMES[cls] = known
            if known.issuperset(data):  # every request but a bad one: one C call
                return data
            for name in data:
                if name not in known:
                    extra = KNOWN_EXTRA[cls.wire_endpoint]
                    near = difflib.get_close_matches(str(name), [*cls.model_fields, *extra], 1)
                    hint = f" (did you mean {near[0]!r}?)" if near else ""
                    raise PydanticCustomError(
                        UNRECOGNIZED, "Unrecognized request argument supplied: {name}{hint}",
                        {"name": str(name)[:64], "hint": hint},
                    )  # fmt: skip
        return data


class ChatCompletionRequest(_Sampling):
    wire_endpoint: ClassVar[str] = "chat"
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: MaxTokens | None = None
    add_generation_prompt: bool = True
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Sampling):
    wire_endpoint: ClassVar[str] = "completions"
    # One prompt: text, token ids, or a batch of exactly one text (batches are not served).
    prompt: NonEmptyStr | TokenIds | Annotated[list[NonEmptyStr], Field(min_length=1, max_length=1)]
    echo: bool = False
    logprobs: TopLogprobs | None = None  # completions: the number of alternatives

    def prompt_text(self) -> str | None:
        if isinstance(self.prompt, str):
            return self.prompt
        if self.prompt and isinstance(self.prompt[0], str):
            return self.prompt[0]  # type: ignore[return-value]
        return None

    def prompt_ids(self) -> list[int] | None:
        return None if self.prompt_text() is not None else list(self.prompt)  # type: ignore[arg-type]

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_tokens


class GenerateWireRequest(_Lenient):
    """SGLang's native `/generate`: text or input_ids, sampling_params as a dict."""

    model_config = ConfigDict(
        json_schema_extra={"oneOf": [{"required": ["text"]}, {"required": ["input_ids"]}]}
    )

    text: NonEmptyStr | SkipJsonSchema[None] = None
    input_ids: TokenIds | SkipJsonSchema[None] = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False
    rid: str | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateWireRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("exactly one of text or input_ids is required")
        return self


def canonical_chat_text(messages: list[Message]) -> str:
    """Role and content in order, so each turn's text extends the previous turn's."""
    # A text content read in place (`Message.text()`'s common case): no call a message.
    return "".join([
        f"<|{m.role}|>{c if type(c := m.content) is str else m.text()}\n" for m in messages
    ])  # fmt: skip


def _fields_only(cls: type[_Sampling]) -> tuple[frozenset[str], SchemaValidator]:
    """`cls`'s top-level names (its fields and KNOWN_EXTRA's), and its validator without
    the unknown-name check (`_refuse_unrecognized`, its one before-validator): for a
    body whose names are all known, which that check passes anyway. The same core
    schema otherwise (fields, config, nested models), so it builds the same object."""
    schema = dict(cls.__pydantic_core_schema__)
    check = schema["schema"]
    if check["type"] != "function-before":  # the model changed: this must follow it
        raise TypeError(f"{cls.__name__}: no unknown-name check to leave out")
    schema["schema"] = check["schema"]
    # pydantic-core hands back a complete class's own validator for a `model` schema of
    # it (its prebuilt one, check included): the class reads as incomplete while this
    # one is built (tests/shared/wire/test_protocol.py checks the check is left out).
    cls.__pydantic_complete__ = False
    try:
        validator = SchemaValidator(schema)
    finally:
        cls.__pydantic_complete__ = True
    return frozenset(cls.model_fields) | KNOWN_EXTRA[cls.wire_endpoint], validator


def _short_routes() -> dict[type, tuple[frozenset[str], SchemaValidator]]:
    """The short routes, or none where this pydantic builds its schemas otherwise: then
    every body takes `model_validate` (a little slower, the same answers)."""
    try:
        return {cls: _fields_only(cls) for cls in (ChatCompletionRequest, CompletionRequest)}
    except Exception:  # another pydantic's schema layout: no short route (tests need one)
        return {}


_FIELDS_ONLY = _short_routes()
_COMPLETION = _FIELDS_ONLY.get(CompletionRequest)


def _validated(cls: type[_Sampling], body: Any) -> Any:
    """`cls.model_validate(body)`, by the shorter route where it gives the same answer.

    A body of known names only is validated without the unknown-name check and without
    `model_validate`'s Python call layer: 1.6 against 2.1 us a completion body (timeit).
    Anything else, and any body the short route refuses, takes `model_validate`, so
    every error is today's, word for word (tests/shared/wire/test_protocol.py)."""
    short = _FIELDS_ONLY.get(cls)
    if short is not None and type(body) is dict and short[0].issuperset(body):
        fields_only = short[1]
        try:
            return fields_only.validate_python(body)
        except ValidationError:
            pass  # the error is raised below, by the model itself
    return cls.model_validate(body)


def chat_request(body: dict[str, Any]) -> ChatCompletionRequest:
    """A chat body validated as `routing_text` validates it, its text not rendered (a
    router that tokenizes routes it on its ids: router/http/handlers.py)."""
    chat: ChatCompletionRequest = _validated(ChatCompletionRequest, body)
    return chat


def routing_text(endpoint: str, body: dict[str, Any]) -> tuple[str, BaseModel]:
    """Validate a request body and return (text to route on, parsed request).

    Raises pydantic.ValidationError on a bad body.
    """
    if endpoint == "chat":
        chat = chat_request(body)
        return canonical_chat_text(chat.messages), chat
    if endpoint == "completions":
        # `_validated`'s short route inlined (the common body: one call less).
        comp: CompletionRequest
        if _COMPLETION is not None and type(body) is dict and _COMPLETION[0].issuperset(body):
            try:
                comp = _COMPLETION[1].validate_python(body)
            except ValidationError:  # raised again by the model itself, word for word
                comp = CompletionRequest.model_validate(body)
        else:
            comp = _validated(CompletionRequest, body)
        prompt = comp.prompt
        # `prompt_text()`'s first case, inlined (the common prompt): one call less.
        text = prompt if type(prompt) is str else comp.prompt_text()
        return (text if text is not None else " ".join(map(str, prompt))), comp
    gen = GenerateWireRequest.model_validate(body)
    return (gen.text if gen.text is not None else " ".join(map(str, gen.input_ids or []))), gen


class GenerateSamplingParams(_Lenient):
    """SGLang's `sampling_params` for `/generate` (validated by the worker)."""

    max_new_tokens: MaxTokens = 128
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: TopK = -1
    min_p: float = Field(0.0, ge=0, le=1)
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: float = Field(1.0, gt=0, le=2)
    seed: int | None = None
    stop: Stop = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False

    def stop_list(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
