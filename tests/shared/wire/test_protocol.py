import json
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from shared.serving.errors import error_body, validation_error
from shared.wire.known_fields import KNOWN_EXTRA
from shared.wire.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    canonical_chat_text,
    routing_text,
)


def test_chat_turns_extend_the_previous_text() -> None:
    turn1 = {
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    }
    turn2 = {
        "messages": [
            *turn1["messages"],
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": [{"type": "text", "text": "more"}]},
        ]
    }
    t1, _ = routing_text("chat", turn1)
    t2, _ = routing_text("chat", turn2)
    assert t2.startswith(t1) and len(t2) > len(t1)


@pytest.mark.parametrize(
    ("endpoint", "body", "param"),
    [
        ("chat", {"messages": []}, "messages"),
        ("chat", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ("chat", {"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}, "max_tokens"),
        ("chat", {"messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p"),
        ("chat", {"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
        (
            "chat",
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 21},
            "top_logprobs",
        ),
        ("completions", {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
        ("completions", {"prompt": ""}, "prompt"),
        ("completions", {}, "prompt"),
        ("completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
        ("completions", {"prompt": "x", "stop": [""]}, "stop"),
        ("generate", {"sampling_params": {}}, None),
    ],
)
def test_bad_requests_name_the_field(endpoint: str, body: dict, param: str | None) -> None:
    with pytest.raises(ValidationError) as e:
        routing_text(endpoint, body)
    err = validation_error(e.value)
    assert err.status == 400
    if param is not None:
        assert err.param is not None and err.param.startswith(param)


def test_completion_prompt_forms() -> None:
    assert CompletionRequest.model_validate({"prompt": [1, 2, 3]}).prompt_ids() == [1, 2, 3]
    assert CompletionRequest.model_validate({"prompt": ["abc"]}).prompt_text() == "abc"
    chat = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 7, "top_k": 1}
    )
    assert chat.effective_max_tokens == 7


def test_error_shape() -> None:
    body = error_body(429, "slow down", code="rate_limited")
    assert body == {
        "error": {
            "message": "slow down",
            "type": "rate_limit_error",
            "param": None,
            "code": "rate_limited",
        }
    }
    assert error_body(503, "x")["error"]["type"] == "server_error"


@pytest.mark.parametrize(
    ("endpoint", "body", "typo", "meant"),
    [
        ("completions", {"prompt": "x", "max_token": 3}, "max_token", "max_tokens"),
        ("chat", {"messages": [{"role": "user", "content": "x"}], "temprature": 0.5},
         "temprature", "temperature"),
    ],
)  # fmt: skip
def test_an_unknown_field_is_refused_by_name(
    endpoint: str, body: dict, typo: str, meant: str
) -> None:
    """Was: ignored, so `max_token` ran with the default length (issue 31)."""
    with pytest.raises(ValidationError) as e:
        routing_text(endpoint, body)
    err = validation_error(e.value)
    assert (err.status, err.param, err.code) == (400, typo, "unknown_parameter")
    assert err.message.startswith(f"Unrecognized request argument supplied: {typo}")
    assert repr(meant) in err.message


def test_stock_engines_documented_fields_pass() -> None:
    chat = {"messages": [{"role": "user", "content": "x"}]}
    for extra in (
        {"priority": 1, "service_tier": "flex"},
        {"guided_json": {}, "min_tokens": 1, "chat_template_kwargs": {}},  # vLLM
        {"regex": "a+", "separate_reasoning": False, "rid": "r1"},  # SGLang
    ):
        assert routing_text("chat", {**chat, **extra})[1].model_extra == extra
    # vLLM's cache_salt is modelled (our engine acts on it): a field, checked non-empty.
    assert routing_text("chat", {**chat, "cache_salt": "s"})[1].cache_salt == "s"
    # OpenAI's prompt_cache_key is modelled too (router/holdings/sessions.py: bounded).
    assert routing_text("chat", {**chat, "prompt_cache_key": "k"})[1].prompt_cache_key == "k"
    body = {"prompt": "x", "prompt_embeds": None, "json_schema": "{}", "suffix": "y"}
    routing_text("completions", body)
    # `/generate` (SGLang's native API) stays lenient.
    routing_text("generate", {"text": "x", "return_logprob": True})


_ROLES = st.sampled_from(["system", "user", "assistant", "tool", "developer"])
_TEXT = st.text(st.characters(codec="utf-8"), max_size=30)
_CONTENT = (
    st.none() | _TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": _TEXT}))
)


@settings(max_examples=300, deadline=None)
@given(
    messages=st.lists(st.fixed_dictionaries({"role": _ROLES, "content": _CONTENT}), min_size=1),
    ensure_ascii=st.booleans(),
)
def test_a_chats_canonical_text_is_shorter_than_its_json_body(
    messages: list[dict], ensure_ascii: bool
) -> None:
    """The router's tokenizer bounds a chat by its body's length instead of its canonical
    text's (router/http/tokenize.py `quick_chars`): the text is never the longer, however
    compact the JSON, in UTF-8 or escaped to ASCII, with parts or none."""
    body = json.dumps({"messages": messages}, ensure_ascii=ensure_ascii, separators=(",", ":"))
    raw = body.encode()
    chat = ChatCompletionRequest.model_validate(json.loads(raw))
    assert len(canonical_chat_text(chat.messages)) < len(raw)


def _random_body(rng: random.Random, endpoint: str) -> dict[str, Any]:
    """A request body of known and unknown names, with values right and wrong."""
    cls = ChatCompletionRequest if endpoint == "chat" else CompletionRequest
    names = [*cls.model_fields, *sorted(KNOWN_EXTRA[endpoint]), "max_token", "temprature"]
    values: list[Any] = [None, True, 0, 1, -1, 4, 2.5, 300, "", "x", "sim", [], [1, 2], ["a"],
                         [""], {}, {"5": 3}, {"include_usage": True}, "é" * 300, 10**30]  # fmt: skip
    messages: list[Any] = [[], [{"role": "user", "content": "hi"}], [{"role": "bot"}],
                           [{"role": "user", "content": [{"type": "text", "text": "a"}]}]]  # fmt: skip
    body: dict[str, Any] = {}
    if rng.random() < 0.9:  # mostly a body with its prompt
        body["messages" if endpoint == "chat" else "prompt"] = (
            rng.choice(messages) if endpoint == "chat" else rng.choice(["hello", [1, 2], ""])
        )
    for name in rng.sample(names, rng.randrange(4)):
        body[name] = rng.choice(messages if name == "messages" else values)
    return body


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_the_short_validation_route_answers_as_the_model_does(endpoint: str) -> None:
    """`routing_text` takes a shorter route than `model_validate` for bodies of known
    names (shared/wire/protocol.py `_validated`): over many random bodies, good and bad,
    it builds the same request (fields, the set ones, the extras) or raises the same
    error, word for word, as the model's own `model_validate`."""
    cls = ChatCompletionRequest if endpoint == "chat" else CompletionRequest
    rng = random.Random(34)
    outcomes = {"valid": 0, "invalid": 0}
    for _ in range(3000):
        body = _random_body(rng, endpoint)
        try:
            want = cls.model_validate(body)
        except ValidationError as e:
            with pytest.raises(ValidationError) as got:
                routing_text(endpoint, body)
            assert got.value.errors() == e.errors() and str(got.value) == str(e), body
            assert vars(validation_error(got.value)) == vars(validation_error(e))  # the 400
            outcomes["invalid"] += 1
            continue
        _, parsed = routing_text(endpoint, body)
        assert type(parsed) is cls and parsed == want, body
        assert parsed.model_fields_set == want.model_fields_set
        assert parsed.model_extra == want.model_extra
        outcomes["valid"] += 1
    assert min(outcomes.values()) > 300, outcomes  # both ways taken often


def test_the_short_route_leaves_the_unknown_name_check_out() -> None:
    """The short route's validator is the model's minus its unknown-name check (else it
    is no shorter: pydantic-core may hand back the class's own validator)."""
    from shared.wire.protocol import _FIELDS_ONLY

    for cls, body in ((CompletionRequest, {"prompt": "x"}),
                      (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]})):  # fmt: skip
        _, fields_only = _FIELDS_ONLY[cls]
        parsed = fields_only.validate_python({**body, "max_token": 3})
        assert type(parsed) is cls and parsed.model_extra == {"max_token": 3}
        with pytest.raises(ValidationError, match="Unrecognized request argument"):
            cls.model_validate({**body, "max_token": 3})
