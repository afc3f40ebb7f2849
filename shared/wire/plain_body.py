"""Request bodies of plain values, checked by hand without building the request model.

The rule: a check made here (`object_check`) takes a decoded JSON object and answers
NO or the extras the model keeps (its names that are not fields, as sent), and never
raises. An answer other than NO promises that `cls.model_validate(value)` succeeds,
holding every field the body sends exactly as sent (an int where a float is due aside:
the model holds its float), so a caller may read the body's own values in place of the
model's. NO means "not decided here": the body takes the model's own validation, which
words every error. A check accepts only what its model accepts and refuses nothing
itself. The rules of the request models (shared/wire/protocol.py) are written out at
the end (`_PLAIN_CHAT`, `_PLAIN_COMPLETION`, `plain_extra` for the handler); a
differential hypothesis test over generated and mutated bodies holds them to the
models (tests/shared/wire/test_plain_body.py).

What a check decides: names it has a rule for (any other: NO, or kept as an extra where
the model keeps it, `extra="allow"`), values of JSON's exact types within the field's
bounds, as strict pydantic takes them (no "5" for 5, no 0 for false). A field's rule is
a table from a value's exact type to what a value of that type must meet: `ACCEPT`
(anything), a `_Range` (a number's), a `_Length` (a text's), a frozenset (a Literal
of strings) or a function (lists, nested objects). Plain values are decided inside the
object's loop, without a call. Lists longer than MAX_ITEMS, a message's content of more
than MAX_PARTS parts and a nested object of more than MAX_KEYS names are the model's:
what a check walks before it answers NO is bounded (256 messages of 16 parts of 16
names), so a body made to fail at its end costs the model's time and little more.

Why: the model's validator costs ~1.5 us a three-field completion body and ~3.2 us a
two-message chat (timeit, pydantic-core 2.50), a dispatch over each of ~25 fields and
an object built for the request and each message; a router that routes on text reads
five of those fields. A check here reads only the names the body sends, ~0.4 us.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from types import FunctionType
from typing import Any, get_args

from pydantic import BaseModel

from shared.wire.known_fields import KNOWN_EXTRA
from shared.wire.protocol import (
    MAX_N,
    MAX_PROMPT_CACHE_KEY_BYTES,
    ChatCompletionRequest,
    CompletionRequest,
    Message,
    StreamOptions,
    TextPart,
)

Rule = dict[type, Any]  # a value's exact type → what it must meet (the module says)
Check = Callable[[dict[str, Any]], Any]

NO: Any = object()  # a check's answer: not decided here (the model decides)
ACCEPT: Any = object()  # a rule's "any value of this type"
_KEEP: Any = object()  # `object_check`'s mark of a name kept as an extra
MAX_ITEMS = 256
MAX_PARTS = 16
MAX_KEYS = 16
I64_MIN, I64_MAX = -(2**63), 2**63 - 1  # "any int": beyond 64 bits, the model's


class _Range:
    """A number within [low, high], or (low, high] where `low_open`."""

    __slots__ = ("high", "low", "low_open")

    def __init__(self, low: float, high: float, low_open: bool = False) -> None:
        self.low, self.high, self.low_open = low, high, low_open


class _Length:
    """A text of [low, high] characters."""

    __slots__ = ("high", "low")

    def __init__(self, low: int, high: int) -> None:
        self.low, self.high = low, high


def _meets(how: Any, value: Any) -> bool:
    """Whether `value` meets its rule's entry for its type (`how`)."""
    if how is ACCEPT:
        return True
    kind = type(how)
    if kind is _Range:
        return value <= how.high and (value > how.low or (value == how.low and not how.low_open))
    if kind is _Length:
        return how.low <= len(value) <= how.high
    if kind is frozenset:
        return value in how
    return how(value) is not NO


# -- rules ----------------------------------------------------------------------------
boolean: Rule = {bool: ACCEPT}


def optional(rule: Rule) -> Rule:
    return {**rule, type(None): ACCEPT}


def text(min_len: int = 0, max_len: int = I64_MAX) -> Rule:
    """A str field, its length in characters within [min_len, max_len]."""
    if min_len == 0 and max_len == I64_MAX:
        return {str: ACCEPT}
    return {str: _Length(min_len, max_len)}


def one_of(*allowed: str) -> Rule:
    """A Literal of strings."""
    return {str: frozenset(allowed)}


def integer(low: int = I64_MIN, high: int = I64_MAX) -> Rule:
    """An int field within [low, high] (a bool is not an int: its type is bool)."""
    return {int: _Range(low, high)}


def number(low: float, high: float, low_open: bool = False) -> Rule:
    """A float field within [low, high] (or (low, high]); an int is taken (strict
    pydantic takes one, as its float)."""
    bounds = _Range(low, high, low_open)
    return {int: bounds, float: bounds}


def either(*rules: Rule) -> Rule:
    """A union whose members take disjoint JSON types, so pydantic's choice is the one
    member that takes the value's type."""
    out: Rule = {}
    for rule in rules:
        if out.keys() & rule.keys():
            raise TypeError("a union's members here must take disjoint types")
        out.update(rule)
    return out


def items(item: Rule, min_len: int = 0, max_len: int = MAX_ITEMS) -> Rule:
    """A list field, each item checked."""
    max_len = min(max_len, MAX_ITEMS)

    def check(value: list[Any]) -> Any:
        if not min_len <= len(value) <= max_len:
            return NO
        try:
            for one in value:
                how = item[type(one)]  # (a type the rule does not take: KeyError, NO)
                if how is not ACCEPT and (
                    how(one) is NO if type(how) is FunctionType else not _meets(how, one)
                ):
                    return NO
        except KeyError:
            return NO
        return value

    return {list: check}


def nested(check: Check) -> Rule:
    """A nested object's rule, from its `object_check`."""
    return {dict: check}


def object_check(
    cls: type[BaseModel], rules: dict[str, Rule], kept: Collection[str] | None = None
) -> Check:
    """The check of a JSON object as `cls` (a model with no validator the rules do not
    say): each name in `rules` checked, a name in `kept` held as an extra, any other
    name NO; `kept` None: any other name passes (`extra="allow"`, none refused; a
    nested object's extras are not read, so it answers {}). A field with no rule is
    the model's (NO); a required field not sent is NO."""
    unknown = rules.keys() - cls.model_fields.keys()
    if unknown:  # the model changed: its rules must follow it
        raise TypeError(f"{cls.__name__}: no fields {sorted(unknown)}")
    required = tuple(name for name, field in cls.model_fields.items() if field.is_required())
    table: dict[str, Any] = dict.fromkeys(kept or (), _KEEP)
    table.update({name: {} for name in cls.model_fields})  # no rule: no type passes
    table.update(rules)
    fields = frozenset(table)
    lenient = kept is None

    def check(value: dict[str, Any]) -> Any:
        if lenient and not fields.issuperset(value):  # its extras pass, unread
            if len(value) > MAX_KEYS:
                return NO
            value = {name: item for name, item in value.items() if name in fields}
        extra = {}
        # Subscripts, not `.get` calls: a name with no rule, or a value of a type its rule
        # does not take, is a KeyError (NO).
        try:
            for name, item in value.items():
                rule = table[name]
                if rule is _KEEP:
                    extra[name] = item
                    continue
                how = rule[type(item)]
                if how is not ACCEPT:  # (the common kinds inline: a call less a field)
                    kind = type(how)
                    if kind is _Range:
                        if not item <= how.high or not (
                            item > how.low or (item == how.low and not how.low_open)
                        ):  # (NaN fails every comparison: the model's)
                            return NO
                    elif kind is _Length:
                        if not how.low <= len(item) <= how.high:
                            return NO
                    elif kind is frozenset:
                        if item not in how:
                            return NO
                    elif how(item) is NO:
                        return NO
        except KeyError:
            return NO
        for name in required:
            if name not in value:
                return NO
        return extra

    return check


# -- the request models' rules (shared/wire/protocol.py) -------------------------------


def _top_k(k: int) -> Any:
    """TopK: -1, or 1 and up."""
    return k if k >= 1 or k == -1 else NO


def _cache_key(key: str) -> Any:
    """`prompt_cache_key` as `_Sampling._key_bound` bounds it."""
    fits = len(key.encode("utf-8", "surrogatepass")) <= MAX_PROMPT_CACHE_KEY_BYTES
    return key if fits else NO


# Each field's rule, as the models' fields state them. `logit_bias`, a token-id or batch
# prompt: no rule (the model's).
_SAMPLING_RULES = {
    "model": optional(text()),
    "max_tokens": optional(integer(1, 1_000_000)),
    "temperature": number(0, 2),
    "top_p": number(0, 1, low_open=True),
    "top_k": {int: _top_k},
    "min_p": number(0, 1),
    "n": integer(1, MAX_N),
    "presence_penalty": number(-2, 2),
    "frequency_penalty": number(-2, 2),
    "repetition_penalty": number(0, 2, low_open=True),
    "seed": optional(integer()),
    "stop": optional(either(text(1), items(text(1), max_len=16))),
    "stop_token_ids": optional(items(integer(0))),
    "ignore_eos": boolean,
    "stream": boolean,
    "stream_options": optional(nested(object_check(StreamOptions, {"include_usage": boolean}))),
    "user": optional(text()),
    "cache_salt": optional(text(1, 256)),
    "prompt_cache_key": optional({str: _cache_key}),
    "cache_pin_ttl": optional(number(0, 86_400)),
}
_TEXT_PART = object_check(TextPart, {"type": one_of("text"), "text": text()})
_ROLES = one_of(*get_args(Message.model_fields["role"].annotation))
_MESSAGE = object_check(Message, {
    "role": _ROLES,
    "content": optional(either(text(), items(nested(_TEXT_PART), max_len=MAX_PARTS))),
    "name": optional(text()),
})  # fmt: skip
_ANY_MESSAGES = items(nested(_MESSAGE), min_len=1)[list]
_ROLE_NAMES = _ROLES[str]


def _messages(value: list[Any]) -> Any:
    """`items(nested(_MESSAGE), min_len=1)`, the common message (a role and a text
    content, nothing else) decided inline: a conversation's check is a loop over its
    messages, 0.5 us a message through `_MESSAGE` against ~0.15 here (42 messages:
    20 -> 4.4-8.5 us, timeit)."""
    if not 1 <= len(value) <= MAX_ITEMS:
        return NO
    for message in value:
        if type(message) is dict and len(message) == 2:
            role = message.get("role")
            if type(role) is str and role in _ROLE_NAMES and type(message.get("content")) is str:
                continue
        return _ANY_MESSAGES(value)  # any other message: the rule's own walk, over them all
    return value


def _turns(value: list[Any]) -> Any:
    """`_messages`, answering a chat's turns (`chat_turns`) where it does not answer NO:
    the list itself where every message is a role and a text content in that order,
    nothing else (the dicts `chat_turns` builds, as the template reads them: the same
    items in the same order); else the rule's walk and `chat_turns`. One pass for the
    check and the turns a router with a tokenizer reads (a 41-message chat: 143k -> 103k
    instructions, `_messages` + `chat_turns` against this, callgrind)."""
    if not 1 <= len(value) <= MAX_ITEMS:
        return NO
    for message in value:
        if type(message) is dict and len(message) == 2:
            first, second = message  # (its names, in order)
            if first == "role" and second == "content":
                role = message["role"]
                if type(role) is str and role in _ROLE_NAMES and type(message["content"]) is str:
                    continue
        return NO if _ANY_MESSAGES(value) is NO else chat_turns(value)
    return value


# `_refuse_unrecognized`'s names: any other is NO (the model refuses it, naming it).
_CHAT_RULES = {
    **_SAMPLING_RULES,
    "messages": {list: _messages},
    "max_completion_tokens": optional(integer(1, 1_000_000)),
    "add_generation_prompt": boolean,
    "logprobs": boolean,
    "top_logprobs": optional(integer(0, 20)),
}
_PLAIN_CHAT = object_check(ChatCompletionRequest, _CHAT_RULES, KNOWN_EXTRA["chat"])
# The same check, the messages taken by `_turns` before it (`plain_chat`).
_PLAIN_CHAT_BUT_MESSAGES = object_check(
    ChatCompletionRequest, {**_CHAT_RULES, "messages": {list: ACCEPT}}, KNOWN_EXTRA["chat"]
)
_PLAIN_COMPLETION = object_check(CompletionRequest, {
    **_SAMPLING_RULES,
    "prompt": text(1),
    "echo": boolean,
    "logprobs": optional(integer(0, 20)),
}, KNOWN_EXTRA["completions"])  # fmt: skip


def chat_text(messages: list[dict[str, Any]]) -> str:
    """`canonical_chat_text` of a chat's messages, read from their JSON: the messages
    of a body its model took (by the hand check or by the model itself), whose values
    are the model's as sent."""
    return "".join([
        f"<|{m['role']}|>{c if type(c := m.get('content')) is str else _parts_text(c)}\n"
        for m in messages
    ])  # fmt: skip


def chat_turns(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    """A chat's messages as the router renders them with the model's template
    (router/http/tokenize.py): role and content only, the content as `Message.text()`
    reads it (text parts joined, none: ""), read from the JSON of a body its model took."""
    return [{"role": m["role"], "content": c if type(c := m.get("content")) is str else _parts_text(c)}
            for m in messages]  # fmt: skip


def _parts_text(content: list[dict[str, Any]] | None) -> str:
    return "" if content is None else "".join([part["text"] for part in content])


def plain_extra(endpoint: str, body: dict[str, Any]) -> dict[str, Any] | None:
    """For a chat or completion body of plain values: the extras its model keeps, its
    other fields read from the body itself, which its model takes as sent (a chat's
    messages by `chat_text` / `chat_turns`, a completion's text `body["prompt"]`).
    None: not decided here (the model's)."""
    extra = (_PLAIN_COMPLETION if endpoint == "completions" else _PLAIN_CHAT)(body)
    return None if extra is NO else extra


def plain_chat(body: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
    """`plain_extra("chat", body)` and, where it is not None, the chat's turns
    (`chat_turns(body["messages"])`, or the body's own messages where they are those
    turns already: `_turns`)."""
    messages = body.get("messages")
    turns = _turns(messages) if type(messages) is list else NO
    if turns is NO:
        return None
    extra = _PLAIN_CHAT_BUT_MESSAGES(body)
    return None if extra is NO else (extra, turns)


def plain_routing(endpoint: str, body: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """`plain_extra`, with the text `routing_text` routes the body on."""
    extra = plain_extra(endpoint, body)
    if extra is None:
        return None
    return body["prompt"] if endpoint == "completions" else chat_text(body["messages"]), extra
