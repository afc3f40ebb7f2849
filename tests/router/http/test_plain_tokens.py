"""A router with a tokenizer reads a chat or completion body of plain values in place
(shared/wire/plain_body.py `plain_extra`, router/http/tokenize.py `ChatPrompt`), as the
router without one does: no request model built. What it hands the proxy (`Routed`: the
ids, the text or its deferred rendering, the namespace, the session key, the model,
stream, the cache key and pin ttl) and its error answers (400s, the refused prompt's
`context_length_exceeded` and its `param`) are the ones the request model gives.

Differentially, over generated bodies and hand cases, with the sim tokenizer and a real
BPE tokenizer (make-tiny-model's): a real router app, served from a thread over
loopback in front of a real fake worker, answers each body twice, by hand and with the
hand check turned off (every body to the model); and both are held to the code before
this reading (`old_request_tokens`, `old_routed`: the handler's model path as it was),
run here on a tokenizer of the same setting."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from router.holdings.namespace import request_namespace
from router.http import handlers, tokenize
from router.http.app import create_app
from router.http.state import TOKENIZE
from router.upstream.proxy import Routed
from shared.config import RouterConfig
from shared.tokens.prompt_tokens import PromptTokens
from shared.wire import plain_body
from shared.wire.plain_body import chat_text, chat_turns, plain_chat, plain_extra
from shared.wire.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateWireRequest,
    canonical_chat_text,
    routing_text,
)
from tests.app_thread import serve_in_thread
from tests.router.fakes import FakeWorker

CONTEXT = 64  # tokens: max_chars 1,024; the tiny tokenizer's refuse_chars 64 x 17 = 1,088
INLINE = 300  # characters: longer prompts are tokenized on the tokenizer's thread
MODELS = {"chat": ChatCompletionRequest, "completions": CompletionRequest}
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


def old_request_tokens(tokens: PromptTokens | None, parsed: object) -> Sequence[int] | None:
    """router/holdings/merge.py `request_tokens` before this reading (ecd65ff), verbatim."""
    if isinstance(parsed, CompletionRequest):
        text = parsed.prompt_text()
        if text is None:
            return parsed.prompt_ids()
        return tokens.text(text) if tokens is not None else None
    if isinstance(parsed, GenerateWireRequest):
        if parsed.input_ids is not None:
            return list(parsed.input_ids)
        return tokens.text(parsed.text) if tokens is not None and parsed.text else None
    if tokens is None or not isinstance(parsed, ChatCompletionRequest):
        return None
    messages = [{"role": m.role, "content": c if type(c := m.content) is str else m.text()}
                for m in parsed.messages]  # fmt: skip
    try:
        return tokens.chat(messages, parsed.add_generation_prompt)
    except Exception:
        return None


class Served:
    """A router with `setting`'s tokenizer in front of a fake worker, each served from a
    thread; the `Routed` of every request recorded."""

    def __init__(self, setting: str, router_url: str, app: Any, worker: FakeWorker) -> None:
        self.setting, self.url, self.app, self.worker = setting, router_url, app, worker
        self.tokens = PromptTokens.load(setting)  # the oracle's own
        self.http = requests.Session()
        self.seen: list[Routed] = []

    def answer(self, endpoint: str, raw: bytes, headers: dict[str, str]) -> dict[str, Any]:
        """What the router answered and handed the proxy."""
        self.seen.clear()
        r = self.http.post(self.url + PATHS[endpoint], data=raw, timeout=30,
                           headers={"Content-Type": "application/json", **headers})  # fmt: skip
        out: dict[str, Any] = {"status": r.status_code}
        if r.status_code == 400:
            out["error"] = r.json()["error"]
        if self.seen:
            (routed,) = self.seen
            out["routed"] = _fields(routed)
        return out


def _fields(routed: Routed) -> dict[str, Any]:
    route = routed.route
    try:
        object.__getattribute__(route, "text")
        deferred = False
    except AttributeError:  # a chat's text still to render (RouteRequest)
        deferred = True
    tokens = routed.tokens
    return {
        "deferred": deferred,
        "text": route.text,
        "tokens": None if tokens is None else list(tokens),
        **{name: getattr(routed, name) for name in Routed.__slots__ if name not in ("route", "tokens")},
        "pin_ttl_type": type(routed.pin_ttl),
        "route": (route.model, route.namespace, route.session_key),
    }  # fmt: skip


def old_routed(served: Served, endpoint: str, body: dict[str, Any], raw: bytes,
               headers: dict[str, str]) -> dict[str, Any]:  # fmt: skip
    """The handler's model path before this reading (ecd65ff), for the fields it hands on
    (a plain body's namespace: no adapter served)."""
    bounds = served.app[TOKENIZE]
    try:
        parsed = MODELS[endpoint].model_validate(body)
    except ValidationError:
        return {"status": 400}
    if endpoint == "chat" and len(raw) <= bounds.quick_chars:
        text, chars = canonical_chat_text(parsed.messages), len(raw)  # (deferred)
    else:
        text, _ = routing_text(endpoint, body)
        chars = len(text)
    if bounds.refuse_chars is not None and chars > bounds.refuse_chars:
        param = "messages" if endpoint == "chat" else "prompt"
        return {"status": 400, "param": param, "code": "context_length_exceeded"}
    ids = old_request_tokens(served.tokens, parsed) if chars <= bounds.max_chars else None
    key = parsed.prompt_cache_key
    return {
        "text": text[: bounds.max_chars],
        "tokens": None if ids is None else list(ids),
        "session_key": headers.get("x-session-id") or parsed.user,
        "model": parsed.model,
        "stream": parsed.stream,
        "namespace": request_namespace(parsed, renders=True, adapter=False),
        "prompt_cache_key": key,
        "pin_ttl": (parsed.cache_pin_ttl or 0.0) if key is not None else 0.0,
    }


@pytest.fixture(scope="module", params=["sim", "tiny"])
def served(request: pytest.FixtureRequest, tiny_model_dir: Path) -> Iterator[Served]:
    setting = "sim" if request.param == "sim" else str(tiny_model_dir)
    worker = FakeWorker("w0", "ok")
    with serve_in_thread(worker.app()) as worker_url:
        config = RouterConfig(
            worker_urls=(worker_url,), host="127.0.0.1", tokenizer=setting,
            max_prompt_tokens=CONTEXT, access_log=False,
        )  # fmt: skip
        app = create_app(config)
        app[TOKENIZE].inline_chars = INLINE  # (quick_chars stays: it bounds the text)
        with serve_in_thread(app) as router_url, pytest.MonkeyPatch.context() as patch:
            one = Served(setting, router_url, app, worker)

            class Recorded(Routed):
                __slots__ = ()

                def __init__(self, *args: Any) -> None:
                    super().__init__(*args)
                    one.seen.append(self)

            patch.setattr(handlers, "Routed", Recorded)
            yield one


def check(served: Served, endpoint: str, body: dict[str, Any],
          headers: dict[str, str] | None = None) -> bool:  # fmt: skip
    """The rule for one body: by hand = by the model = as before. True where the hand
    check took it."""
    headers = headers or {}
    raw = json.dumps(body).encode()
    by_hand = served.answer(endpoint, raw, headers)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(handlers, "plain_extra", lambda endpoint, body: None)
        by_model = served.answer(endpoint, raw, headers)
    assert by_hand == by_model, body
    old = old_routed(served, endpoint, body, raw, headers)
    assert by_hand["status"] == old.pop("status", 200), (body, by_hand)
    if "param" in old:
        error = by_hand["error"]
        assert (error["param"], error["code"]) == (old["param"], old["code"]), body
    elif "routed" in by_hand:
        routed = by_hand["routed"]
        assert {name: routed[name] for name in old} == old, body
        assert routed["deferred"] == (
            endpoint == "chat" and len(raw) <= served.app[TOKENIZE].quick_chars
        )
    return plain_extra(endpoint, body) is not None


SHORT = st.sampled_from(["", "hi", "Hello, world!", "naïve café ☕", "x<|user|>y", "a\n\nb", " "])
LONG = st.builds(lambda word, n: word * n, st.sampled_from(["word ", "ab", "é", "<|im_start|>"]),
                 st.sampled_from([60, 200, 250, 400, 1200]))  # fmt: skip
TEXT = st.one_of(SHORT, LONG, st.text(max_size=20))
PART = st.fixed_dictionaries({"type": st.just("text"), "text": TEXT},
                             optional={"x": st.just(1)})  # fmt: skip
CONTENT = st.one_of(TEXT, st.none(), st.lists(PART, max_size=18))  # (past 16 parts: the model's)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer"])},
    optional={"content": CONTENT, "name": st.sampled_from(["n", "", None]),
              "tool_call_id": st.just("c1")},
)  # fmt: skip
COMMON = {
    "model": st.sampled_from(["m", "sim", None]),
    "cache_salt": st.sampled_from(["s", "salt-2"]),
    "prompt_cache_key": st.sampled_from(["k1", "k2"]),
    "cache_pin_ttl": st.sampled_from([0, 300, 2.5, None]),
    "user": st.sampled_from(["u", ""]),
    "stream": st.booleans(),
    "max_tokens": st.just(4),
    "temperature": st.sampled_from([0, 0.5, 3]),  # 3: a 400
    "lora_path": st.just("a1"),
}
CHAT = st.fixed_dictionaries(
    {"messages": st.lists(MESSAGE, min_size=1, max_size=5)},
    optional={**COMMON, "add_generation_prompt": st.booleans(),
              "chat_template": st.sampled_from(["{{ messages }}", ""]),
              "chat_template_kwargs": st.sampled_from([{}, {"enable_thinking": False}, {"x": [1]}])},
)  # fmt: skip
COMPLETION = st.fixed_dictionaries(
    {"prompt": st.one_of(TEXT.filter(bool), st.lists(TEXT.filter(bool), min_size=1, max_size=1),
                         st.lists(st.integers(0, 500), min_size=1, max_size=8))},
    optional={**COMMON, "echo": st.booleans()},
)  # fmt: skip


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(endpoint=st.sampled_from(["chat", "completions"]), data=st.data(),
       session=st.sampled_from([{}, {"x-session-id": "s1"}]))  # fmt: skip
def test_a_body_tokenized_by_hand_is_routed_as_the_model_would_have_it(
    served: Served, endpoint: str, data: st.DataObject, session: dict[str, str]
) -> None:
    body = data.draw(CHAT if endpoint == "chat" else COMPLETION)
    check(served, endpoint, body, session)


def _chat(*messages: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"messages": list(messages), "max_tokens": 4, **fields}


SYSTEM = {"role": "system", "content": "Be brief. " * 20}
USER = {"role": "user", "content": "Hello there?"}
PARTS = {
    "role": "user",
    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b c"}],
}
HAND: list[tuple[str, dict[str, Any], bool]] = [  # (endpoint, body, taken by hand)
    ("chat", _chat(SYSTEM, USER), True),
    ("chat", _chat(SYSTEM, PARTS), True),
    ("chat", _chat(SYSTEM, {"role": "assistant", "content": None}, USER), True),
    ("chat", _chat(SYSTEM, {"role": "assistant"}, USER), True),
    ("chat", _chat({**USER, "name": "bob"}, {"role": "tool", "content": "4", "tool_call_id": "c"}), True),
    ("chat", _chat(SYSTEM, USER, add_generation_prompt=False), True),
    ("chat", _chat(SYSTEM, USER, add_generation_prompt=True), True),
    ("chat", _chat(USER, chat_template="{{ messages }}"), True),
    ("chat", _chat(USER, chat_template_kwargs={"enable_thinking": False}), True),
    ("chat", _chat(USER, cache_salt="s", model="m"), True),
    ("chat", _chat(USER, prompt_cache_key="k", cache_pin_ttl=300, user="u"), True),
    ("chat", _chat(USER, stream=True, stream_options={"include_usage": True}), True),
    # past quick_chars: the text rendered, its length the bound's (`tok` sim: not refused)
    ("chat", _chat(SYSTEM, {"role": "user", "content": "word " * 180}), True),
    ("chat", _chat(SYSTEM, {"role": "user", "content": "w" * 1000}), True),  # too long
    ("chat", _chat(SYSTEM, {"role": "user", "content": "w" * 1070}), True),  # band of 16-17x
    ("chat", _chat({"role": "user", "content": "w" * 3000}), True),  # the tiny's: refused
    ("chat", _chat({"role": "user", "content": [{"type": "text", "text": "w" * 700}] * 3}), True),
    ("chat", _chat({"role": "user", "content": [{"type": "text", "text": "a"}] * 17}), False),
    ("chat", _chat(*[USER] * 257), False),  # over MAX_ITEMS: the model's
    ("chat", _chat(USER, temperature=3), False),  # a 400
    ("chat", _chat({"role": "bot", "content": "x"}), False),  # a 400
    ("completions", {"prompt": "hello", "max_tokens": 4, "cache_salt": "s"}, True),
    ("completions", {"prompt": "w" * 1000}, True),  # too long
    ("completions", {"prompt": "w" * 3000}, True),  # the tiny's: refused
    ("completions", {"prompt": ["hello"], "prompt_cache_key": "k"}, False),
    ("completions", {"prompt": [1, 2, 3]}, False),
    ("completions", {"prompt": ""}, False),  # a 400
]  # fmt: skip


@pytest.mark.parametrize(("endpoint", "body", "by_hand"), HAND, ids=range(len(HAND)))
def test_hand_cases(served: Served, endpoint: str, body: dict[str, Any], by_hand: bool) -> None:
    assert check(served, endpoint, body, {"x-session-id": "s1"}) is by_hand


def test_a_refused_prompt_names_its_field(served: Served) -> None:
    """The refuse bound answers as before, by hand: 400 context_length_exceeded naming
    `messages` for a chat, `prompt` for a completion (the tiny tokenizer's; the sim
    tokenizer has no longest token, and refuses nothing)."""
    for endpoint, body in (("chat", _chat({"role": "user", "content": "w" * 3000})),
                           ("completions", {"prompt": "w" * 3000})):  # fmt: skip
        answer = served.answer(endpoint, json.dumps(body).encode(), {})
        if served.setting == "sim":
            assert answer["status"] == 200
        else:
            assert answer["status"] == 400 and "routed" not in answer
            param = "messages" if endpoint == "chat" else "prompt"
            assert (answer["error"]["param"], answer["error"]["code"]) == (
                param,
                "context_length_exceeded",
            )


def test_a_broken_reading_is_caught(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    """The differential test can fail: a chat's turns read with their text parts joined
    by a space, or a missing content as "None", give other ids than the model path did,
    and the rule's assertion says so."""
    real = tokenize.chat_turns
    body = _chat(SYSTEM, {"role": "assistant", "content": None}, PARTS)
    check(served, "chat", body)

    def spaced(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
        return [{"role": m["role"], "content": " ".join(p["text"] for p in m["content"])}
                if type(m.get("content")) is list else turn
                for m, turn in zip(messages, real(messages), strict=True)]  # fmt: skip

    def none_named(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
        return [{**turn, "content": str(m.get("content"))} if m.get("content") is None else turn
                for m, turn in zip(messages, real(messages), strict=True)]  # fmt: skip

    for broken in (spaced, none_named):
        monkeypatch.setattr(tokenize, "chat_turns", broken)  # the model path's
        monkeypatch.setattr(plain_body, "chat_turns", broken)  # the hand check's (plain_chat)
        with pytest.raises(AssertionError):
            check(served, "chat", body)


@pytest.fixture(scope="module", params=["sim", "tiny"])
def prompt_tokens(request: pytest.FixtureRequest, tiny_model_dir: Path) -> PromptTokens:
    return PromptTokens.load("sim" if request.param == "sim" else str(tiny_model_dir))


def _ids(ids: Sequence[int] | None) -> list[int] | None:
    return None if ids is None else list(ids)


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=CHAT)
def test_a_chats_prompt_read_from_its_json_is_its_models(
    prompt_tokens: PromptTokens, body: dict[str, Any]
) -> None:
    """In process, more bodies: any chat its model takes (the hand check's or not, past
    16 parts too) gives the same ids and text read from its JSON as from its model."""
    try:
        parsed = ChatCompletionRequest.model_validate(body)
    except ValidationError:
        return
    old = _ids(old_request_tokens(prompt_tokens, parsed))
    prompt = tokenize.request_prompt(parsed, body)
    assert _ids(tokenize.request_tokens(prompt_tokens, prompt)) == old
    assert chat_text(body["messages"]) == canonical_chat_text(parsed.messages)
    read = plain_chat(body)
    assert (read is None) is (plain_extra("chat", body) is None)
    if read is not None:  # the handler's own reading
        assert read[0] == plain_extra("chat", body)
        assert read[1] == chat_turns(body["messages"])
        by_hand = tokenize.ChatPrompt(read[1], body.get("add_generation_prompt") is not False)
        assert _ids(tokenize.request_tokens(prompt_tokens, by_hand)) == old
