import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from shared.serving.errors import error_body, validation_error
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
