"""The inference handler reads a body of plain values in place (shared/wire/plain_body.py
`plain_extra`, no request model built), with a tokenizer or without: what it hands the
proxy, what the worker receives and what the client gets back are the same as through
the request model. A real router app over loopback in front of a real fake worker, each
body sent twice: through the hand check, then with it turned off (every body to the
model). tests/router/http/test_plain_tokens.py holds the tokenized reading to the code
before it."""

from __future__ import annotations

from typing import Any

import pytest

from router.http import handlers
from router.upstream.proxy import Routed
from tests.router.conftest import StartRouter, StartWorkers

TENANTS = {"a": {"keys": ["key-a"]}}
CHAT = [{"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}], "name": "u1"}]  # fmt: skip
BODIES: list[tuple[str, dict[str, Any], dict[str, str]]] = [
    ("/v1/completions", {"model": "m", "prompt": "hello", "max_tokens": 4}, {}),
    (
        "/v1/completions",
        {
            "prompt": "p",
            "user": "u",
            "stream": False,
            "temperature": 0,
            "prompt_cache_key": "s1",
            "cache_pin_ttl": 300,
        },
        {},
    ),
    (
        "/v1/completions",
        {"prompt": "p", "prompt_cache_key": "s2", "cache_pin_ttl": 0},
        {"Authorization": "Bearer key-a"},
    ),
    (
        "/v1/completions",
        {
            "prompt": "p",
            "prompt_cache_key": "s3",
            "cache_pin_ttl": 2.5,
            "cache_salt": "salt",
            "priority": 2,
        },
        {"x-session-id": "s"},
    ),
    ("/v1/completions", {"prompt": "p", "lora_path": "adapter-1", "service_tier": "flex"}, {}),
    (
        "/v1/chat/completions",
        {"model": "m", "messages": CHAT, "user": "u2", "prompt_cache_key": "s4"},
        {"x-session-id": ""},
    ),
    (
        "/v1/chat/completions",
        {
            "messages": CHAT,
            "chat_template_kwargs": {"x": 1},
            "priority": 1,
            "service_tier": "priority",
        },
        {},
    ),
    ("/v1/chat/completions", {"messages": CHAT, "service_tier": "nonsense"}, {}),  # a 400
]


async def _send_all(
    start_router: StartRouter, url: str, seen: list[Routed], tokenizer: str | None
) -> list[Any]:
    client = await start_router(
        [url], tenants=TENANTS, api_keys=("key-a", "key-b"), tokenizer=tokenizer
    )
    out = []
    for path, body, headers in BODIES:
        headers = {"Authorization": "Bearer key-b", **headers}
        r = await client.post(path, json=body, headers=headers)
        answer = await r.json()
        answer.pop("id", None)
        routed = [
            (name, getattr(x, name), type(getattr(x, name)))
            for x in seen
            for name in (*Routed.__slots__, "text")
            if name != "route"
        ]
        tokens = [None if x.tokens is None else list(x.tokens) for x in seen]
        route = [(x.route.text, x.route.model, x.route.namespace, x.route.session_key, x.route.tokens)
             for x in seen]  # fmt: skip
        out.append((r.status, answer, routed, route, tokens))
        seen.clear()
    return out


@pytest.mark.parametrize("tokenizer", [None, "sim"])
async def test_a_plain_body_is_handed_on_as_the_model_would_have_it(
    start_router: StartRouter,
    fake_workers: StartWorkers,
    monkeypatch: pytest.MonkeyPatch,
    tokenizer: str | None,
) -> None:
    ((worker, server),) = await fake_workers("ok")
    url = str(server.make_url("")).rstrip("/")
    seen: list[Routed] = []
    checked: list[bool] = []

    class Recorded(Routed):
        __slots__ = ()

        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            seen.append(self)

    real, real_chat = handlers.plain_extra, handlers.plain_chat

    def counted(endpoint: str, body: dict[str, Any]) -> Any:
        answer = real(endpoint, body)
        checked.append(answer is not None)
        return answer

    def counted_chat(body: dict[str, Any]) -> Any:  # a chat to tokenize: the check and turns
        answer = real_chat(body)
        checked.append(answer is not None)
        return answer

    monkeypatch.setattr(handlers, "Routed", Recorded)
    monkeypatch.setattr(handlers, "plain_extra", counted)
    monkeypatch.setattr(handlers, "plain_chat", counted_chat)
    by_hand = await _send_all(start_router, url, seen, tokenizer)
    sent_by_hand = [(h, b) for h, b in zip(worker.headers_seen, worker.bodies_seen, strict=True)]
    assert all(checked) and len(checked) == len(BODIES)  # every body took the hand check
    worker.headers_seen.clear()
    worker.bodies_seen.clear()
    monkeypatch.setattr(handlers, "plain_extra", lambda endpoint, body: None)
    monkeypatch.setattr(handlers, "plain_chat", lambda body: None)
    by_model = await _send_all(start_router, url, seen, tokenizer)
    sent_by_model = list(zip(worker.headers_seen, worker.bodies_seen, strict=True))
    assert by_hand == by_model
    assert [status for status, *_ in by_hand].count(400) == 1  # the bad service tier

    def without_ids(sent: list[tuple[dict[str, str], dict]]) -> list[Any]:
        return [({k: v for k, v in h.items() if k.lower() != "x-request-id"}, b) for h, b in sent]

    assert without_ids(sent_by_hand) == without_ids(sent_by_model)
    assert len(sent_by_hand) == len(BODIES) - 1
