"""The hand check of plain chat and completion bodies (shared/wire/plain_body.py) against
the request models it stands in for, differentially: over generated and mutated bodies,
a body the check passes is one its model takes as sent (the same values and types, an
int where a float is due aside, the same extras), with the same routing text; a body it
leaves is the model's (errors are the model's, word for word, by construction)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from shared.wire import plain_body as plain
from shared.wire.known_fields import KNOWN_EXTRA
from shared.wire.plain_body import plain_routing
from shared.wire.protocol import ChatCompletionRequest, CompletionRequest, routing_text

MODELS: dict[str, type[BaseModel]] = {
    "chat": ChatCompletionRequest,
    "completions": CompletionRequest,
}

# Values at and just past every bound the models state, of every JSON type.
EDGES: list[Any] = [
    None, True, False, 0, 1, -1, -2, 2, 3, 16, 20, 21, 128, 129, 1_000_000, 1_000_001,
    2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 0.0, -0.0, 1e-9, 0.5, 1.0, 1.0000001, 1.5, 2.0,
    2.0000001, -2.0, -2.0000001, 100.0, -100.5, 86_400, 86_400.5, float("nan"),
    float("inf"), -float("inf"), "", "x", "sim", "a" * 256, "a" * 257, "\U0001f600" * 256,
    "\U0001f600" * 257, [], ["a"], [""], ["a"] * 16, ["a"] * 17, [1, 2], [0], [-1], [True],
    [1.0], {}, {"include_usage": True}, {"include_usage": 1}, {"include_usage": None},
    {"include_usage": False, "x": 1}, {"5": 3}, {"5": 101},
]  # fmt: skip
ROLES = ["system", "user", "assistant", "tool", "developer", "bot", "", "User"]


def _names(endpoint: str) -> list[str]:
    cls = MODELS[endpoint]
    return [*cls.model_fields, *sorted(KNOWN_EXTRA[endpoint]), "max_token", "temprature", ""]


parts = st.lists(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url", "", 1])},
        optional={"text": st.sampled_from(["a", "", 3, None]), "x": st.just([1])},
    ),
    max_size=3,
)
messages = st.lists(
    st.fixed_dictionaries(
        {},
        optional={
            "role": st.sampled_from([*ROLES, 1, None]),
            "content": st.one_of(st.sampled_from(["hi", "", None, 1, True, {}]), parts),
            "name": st.sampled_from(["n", "", None, 1]),
            "tool_call_id": st.just("t1"),
        },
    ),
    max_size=4,
)


def _value(name: str) -> st.SearchStrategy[Any]:
    if name == "messages":
        return st.one_of(messages, st.sampled_from(EDGES))
    return st.sampled_from(EDGES)


@st.composite
def bodies(draw: st.DrawFn, endpoint: str) -> dict[str, Any]:
    """A body near a valid one: its prompt mostly right, a few names of every kind,
    values at and past the bounds, then perhaps one value mutated or a name dropped."""
    body: dict[str, Any] = {}
    if endpoint == "chat":
        body["messages"] = draw(st.one_of(
            st.just([{"role": "user", "content": "hi"}]), messages, st.sampled_from(EDGES)
        ))  # fmt: skip
    else:
        body["prompt"] = draw(st.sampled_from(["hello", "", [1, 2], ["a"], None, 5]))
    for name in draw(st.lists(st.sampled_from(_names(endpoint)), max_size=5, unique=True)):
        body[name] = draw(_value(name))
    if body and draw(st.booleans()):
        name = draw(st.sampled_from(sorted(body)))
        if draw(st.booleans()):
            del body[name]
        else:
            body[name] = draw(_value(name))
    return body


def _same(sent: Any, held: Any, path: str = "") -> None:
    """`held` (the model's dump) is `sent` exactly, types too; an int sent where the
    model holds a float is the one difference a float field makes."""
    if type(sent) is int and type(held) is float:
        assert sent == held, path
        return
    assert type(sent) is type(held), (path, sent, held)
    if type(sent) is dict:
        assert list(sent) == list(held) or sent.keys() == held.keys(), path
        for key in sent:
            _same(sent[key], held[key], f"{path}.{key}")
    elif type(sent) is list:
        assert len(sent) == len(held), path
        for i, (a, b) in enumerate(zip(sent, held, strict=True)):
            _same(a, b, f"{path}.{i}")
    else:
        assert sent == held or (sent != sent and held != held), (path, sent, held)  # NaN


def _agrees(endpoint: str, body: dict[str, Any], routing: Callable[..., Any]) -> bool:
    """The module's rule for one body; True where the hand check decided it."""
    cls = MODELS[endpoint]
    checked = routing(endpoint, body)
    try:
        model = cls.model_validate(body)
    except ValidationError:
        assert checked is None, body  # passed by hand, refused by the model
        return False
    if checked is None:
        return False
    text, extra = checked
    assert (text, model) == routing_text(endpoint, body)
    assert extra == model.model_extra and type(extra) is dict
    _same(body, model.model_dump(exclude_unset=True))
    assert model.model_fields_set == set(body)
    return True


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_body_the_hand_check_passes_is_the_models_as_sent(
    endpoint: str, data: st.DataObject
) -> None:
    _agrees(endpoint, data.draw(bodies(endpoint)), plain_routing)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_the_hand_check_decides_many_bodies_both_ways(endpoint: str) -> None:
    """Mutations of valid bodies, one field at a time: the rule holds, and the check
    decides a good share of them (it is not a check that passes nothing)."""
    rng = random.Random(34)
    base: dict[str, Any] = (
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        if endpoint == "chat"
        else {"model": "m", "prompt": "hello", "max_tokens": 4}
    )
    decided = kept = 0
    names = _names(endpoint)
    for _ in range(3000):
        body = dict(base)
        for name in rng.sample(names, rng.randrange(1, 4)):
            body[name] = rng.choice(EDGES)
        if _agrees(endpoint, body, plain_routing):
            decided += 1
        else:
            kept += 1
    assert decided > 300 and kept > 300, (decided, kept)


def _base(endpoint: str) -> dict[str, Any]:
    if endpoint == "chat":
        return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return {"model": "m", "prompt": "hello", "max_tokens": 4}


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_every_name_at_every_edge(endpoint: str) -> None:
    """Exhaustively, one name at a time: every field and known name of the model (and
    a few unknown ones) at every edge value, on a valid body."""
    decided = 0
    for name in _names(endpoint):
        for value in EDGES:
            decided += _agrees(endpoint, {**_base(endpoint), name: value}, plain_routing)
    assert decided > 500, decided


MESSAGE_EDGES: dict[str, list[Any]] = {
    "role": [*ROLES, 1, None, ["user"]],
    "content": ["hi", "", None, 1, True, {}, [], [{"type": "text", "text": "a"}],
                [{"type": "text"}], [{"type": "text", "text": None}], [{"text": "a"}],
                [{"type": "image_url", "text": "a"}], [{"type": "text", "text": "a", "x": 1}],
                ["a"], [None]],
    "name": ["n", "", None, 1, True],
    "tool_call_id": ["t", 1, None],
}  # fmt: skip


def test_every_message_key_at_every_edge() -> None:
    """Exhaustively, a chat's one message: each key at each of its edge values, alone
    and beside a valid role and content, and messages dropped or not objects."""
    for key, values in MESSAGE_EDGES.items():
        for value in values:
            for message in ({key: value}, {"role": "user", "content": "hi", key: value}):
                body = {**_base("chat"), "messages": [{"role": "system", "content": "s"}, message]}
                _agrees("chat", body, plain_routing)
    for messages in ([], [None], ["hi"], [[]], [{"role": "user", "content": "x"}] * 300):
        _agrees("chat", {**_base("chat"), "messages": messages}, plain_routing)


COMMON = [
    ("completions", {"model": "sim", "prompt": "hello there", "max_tokens": 4}),
    ("completions", {"model": "m", "prompt": "p", "max_tokens": 16, "temperature": 0,
                     "top_p": 1, "n": 1, "stream": True, "stream_options": {"include_usage": True},
                     "stop": ["\n"], "seed": 7, "user": "u", "logprobs": 2, "echo": False}),
    ("chat", {"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                         {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                                         {"role": "assistant", "content": None, "tool_calls": []},
                                         {"role": "tool", "content": "4", "tool_call_id": "c1"}],
              "max_completion_tokens": 8, "temperature": 0.7, "presence_penalty": -2,
              "prompt_cache_key": "s1", "cache_pin_ttl": 300, "cache_salt": "salt",
              "priority": 3, "service_tier": "flex", "lora_path": "a", "chat_template_kwargs": {}}),
]  # fmt: skip


@pytest.mark.parametrize(("endpoint", "body"), COMMON)
def test_common_bodies_are_decided_by_hand(endpoint: str, body: dict[str, Any]) -> None:
    assert _agrees(endpoint, body, plain_routing), body


def test_what_a_check_walks_before_no_is_bounded() -> None:
    """A message of more than MAX_KEYS names, a content of more than MAX_PARTS parts and
    more than MAX_ITEMS messages are left to the model (valid as they are): a body made
    to fail at its far end makes the hand check walk a bounded amount first."""
    part = {"type": "text", "text": "a"}
    wide = {"role": "user", "content": "x", **{f"k{i}": i for i in range(plain.MAX_KEYS)}}
    for messages, decided in (
        ([{**wide, "k": 0}], False),
        ([dict(list(wide.items())[: plain.MAX_KEYS])], True),
        ([{"role": "user", "content": [part] * (plain.MAX_PARTS + 1)}], False),
        ([{"role": "user", "content": [part] * plain.MAX_PARTS}], True),
        ([{"role": "user", "content": "x"}] * (plain.MAX_ITEMS + 1), False),
        ([{"role": "user", "content": "x"}] * plain.MAX_ITEMS, True),
    ):
        body = {"messages": messages}
        assert _agrees("chat", body, plain_routing) is decided
        ChatCompletionRequest.model_validate(body)  # every one the model's to take


def test_a_looser_check_is_caught() -> None:
    """The differential test can fail: a completion check whose `max_tokens` bound is
    one too wide passes a body the model refuses, and the rule's assertion says so."""
    loose = plain.object_check(CompletionRequest, {
        **plain._SAMPLING_RULES, "max_tokens": plain.optional(plain.integer(1, 1_000_001)),
        "prompt": plain.text(1),
    }, KNOWN_EXTRA["completions"])  # fmt: skip

    def routing(endpoint: str, body: dict[str, Any]) -> Any:
        extra = loose(body)
        return None if extra is plain.NO else (body["prompt"], extra)

    assert _agrees("completions", {"prompt": "x", "max_tokens": 1_000_000}, routing)
    with pytest.raises(AssertionError):
        _agrees("completions", {"prompt": "x", "max_tokens": 1_000_001}, routing)


def test_the_rules_name_only_fields_of_their_model() -> None:
    """A rule for a field the model does not have is refused when the check is made
    (a renamed field must take its rule along)."""
    with pytest.raises(TypeError, match="no fields"):
        plain.object_check(CompletionRequest, {"max_token": plain.integer()})


@settings(max_examples=1500, deadline=None)
@given(value=st.one_of(messages, st.lists(st.fixed_dictionaries({
    "role": st.sampled_from([*ROLES, 1, None]), "content": st.sampled_from(["hi", "", None, 1])}),
    min_size=1, max_size=4)))  # fmt: skip
def test_the_common_messages_are_decided_as_the_rule_decides_them(value: list[Any]) -> None:
    """`_messages` (a role and a text content decided inline) answers as the messages'
    rule does, message by message (`items(nested(_MESSAGE))`), for any list."""
    rule = plain.items(plain.nested(plain._MESSAGE), min_len=1)[list]
    assert (plain._messages(value) is plain.NO) is (rule(value) is plain.NO), value


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_chat_read_with_its_turns_is_the_check_and_chat_turns(data: st.DataObject) -> None:
    """`plain_chat` (the check and the turns in one pass: `_turns`) answers as
    `plain_extra` does, and its turns are `chat_turns`' (the same dicts: names in the
    same order, the same values), for bodies near valid ones, their messages' names
    in any order."""
    body = data.draw(bodies("chat"))
    messages = body.get("messages")
    if type(messages) is list and data.draw(st.booleans()):
        body["messages"] = [
            {key: m[key] for key in reversed(m)} if type(m) is dict and data.draw(st.booleans())
            else m for m in messages
        ]  # fmt: skip
    read, extra = plain.plain_chat(body), plain.plain_extra("chat", body)
    assert (read is None) is (extra is None), body
    if read is not None:
        turns = plain.chat_turns(body["messages"])
        assert read[0] == extra and read[1] == turns
        assert [(type(t), list(t)) for t in read[1]] == [(type(t), list(t)) for t in turns]
