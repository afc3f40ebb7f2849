"""The worker HTTP app over loopback (pytest-aiohttp), on the sim engine."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from tests.waiting import wait_until
from tests.worker.conftest import sim_config
from worker.backends import build_engine
from worker.engine.async_engine import AsyncEngine
from worker.http.app import create_app
from worker.http.state import ENGINE, STATE

Client = TestClient[web.Request, web.Application]
MakeClient = Callable[..., Awaitable[Client]]
LONG = "You are a careful assistant; answer in one line. " * 20


async def started(aiohttp_client: MakeClient, **overrides: Any) -> Client:
    config = sim_config(**overrides)
    app = create_app(config, build_engine(config))
    client = await aiohttp_client(app, server_kwargs={"handler_cancellation": True})
    await asyncio.wait_for(app[STATE].ready.wait(), 10)
    return client


def engine_of(client: Client) -> AsyncEngine:
    engine = client.app[ENGINE]
    assert isinstance(engine, AsyncEngine)
    return engine


def assert_error_shape(body: dict[str, Any]) -> dict[str, Any]:
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


async def sse_events(resp: aiohttp.ClientResponse) -> list[Any]:
    events = []
    async for line in resp.content:
        if line.startswith(b"data: "):
            data = line[6:].strip()
            events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return events


async def test_completion_and_chat_report_cached_tokens(aiohttp_client: MakeClient) -> None:
    client = await started(aiohttp_client)
    r1 = await client.post("/v1/completions", json={"prompt": LONG + "one", "max_tokens": 5})
    r2 = await client.post("/v1/completions", json={"prompt": LONG + "two", "max_tokens": 5})
    b1, b2 = await r1.json(), await r2.json()
    assert r1.status == r2.status == 200
    assert b1["id"].startswith("cmpl-") and b1["object"] == "text_completion"
    assert b1["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert b2["usage"]["prompt_tokens_details"]["cached_tokens"] > 100
    assert b2["usage"]["completion_tokens"] == 5
    chat = await client.post("/v1/chat/completions", json={
        "model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})  # fmt: skip
    body = await chat.json()
    assert (
        body["id"].startswith("chatcmpl-") and body["choices"][0]["message"]["role"] == "assistant"
    )
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert chat.headers["x-worker-id"] == "sim-test"
    engine_of(client).engine.check_integrity()


async def test_streaming_chat_with_usage(aiohttp_client: MakeClient) -> None:
    client = await started(aiohttp_client)
    resp = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "stream"}], "max_tokens": 6, "stream": True,
        "stream_options": {"include_usage": True}})  # fmt: skip
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    assert resp.headers["x-worker-id"] == "sim-test"
    events = await sse_events(resp)
    assert events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    assert usage["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert events[-3]["choices"][0]["finish_reason"] == "length"
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-2])
    plain = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "stream"}], "max_tokens": 6})  # fmt: skip
    assert (await plain.json())["choices"][0]["message"]["content"] == text


async def test_generate_endpoint(aiohttp_client: MakeClient) -> None:
    client = await started(aiohttp_client)
    resp = await client.post(
        "/generate", json={"text": LONG, "sampling_params": {"max_new_tokens": 3}}
    )
    body = await resp.json()
    assert body["meta_info"]["completion_tokens"] == 3 and len(body["output_ids"]) == 3
    assert body["meta_info"]["finish_reason"] == {"type": "length"}
    resp = await client.post("/generate", json={
        "input_ids": [300, 301, 302], "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        "stream": True})  # fmt: skip
    events = await sse_events(resp)
    assert events[-1] == "[DONE]"
    assert events[-2]["meta_info"]["completion_tokens"] == 4
    # Incremental (SGLang's --incremental-streaming-output): the chunks add up to the text
    # and ids of the same request unstreamed, each sent once.
    whole = await (await client.post("/generate", json={
        "input_ids": [300, 301, 302], "sampling_params": {"max_new_tokens": 4, "temperature": 0},
    })).json()  # fmt: skip
    chunks = events[:-1]
    assert "".join(e["text"] for e in chunks) == whole["text"]
    assert [i for e in chunks for i in e["output_ids"]] == whole["output_ids"]
    again = await client.post(
        "/generate", json={"text": LONG, "sampling_params": {"max_new_tokens": 3}}
    )
    assert (await again.json())["meta_info"]["cached_tokens"] > 0


BAD_REQUESTS = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"prompt": 5, "max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": 9}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", {"prompt": "word " * 600, "max_tokens": 1}, 400, "prompt"),
    ("/v1/completions", {"prompt": [99999999999]}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, None),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "word " * 600}]},
        400,
        "messages",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
        400,
        "max_tokens",
    ),
    # A typo is refused by name, as OpenAI's API does (issue 31: it was ignored).
    ("/v1/completions", {"prompt": "hi", "max_token": 3}, 400, "max_token"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "max_token": 3},
        400,
        "max_token",
    ),
    ("/generate", {"sampling_params": {}}, 400, None),
    (
        "/generate",
        {"text": "x", "sampling_params": {"max_new_tokens": -2}},
        400,
        "sampling_params.max_new_tokens",
    ),
    ("/generate", {"text": "x", "sampling_params": 7}, 400, "sampling_params"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_REQUESTS)
async def test_bad_input_gets_openai_errors(
    aiohttp_client: MakeClient, path: str, body: Any, status: int, param: str | None
) -> None:
    client = await started(aiohttp_client, max_model_len=512)
    kwargs = {"data": body} if isinstance(body, bytes) else {"json": body}
    resp = await client.post(path, **kwargs)
    assert resp.status == status, await resp.text()
    err = assert_error_shape(await resp.json())
    if param is not None:  # pydantic may name the union member: "prompt.str"
        assert err["param"] == param or err["param"].startswith(param + "."), err
    assert resp.headers["x-worker-id"] == "sim-test"
    ok = await client.post("/v1/completions", json={"prompt": "still fine", "max_tokens": 2})
    assert ok.status == 200
    engine_of(client).engine.check_integrity()


async def test_body_limit_and_unknown_route(aiohttp_client: MakeClient) -> None:
    client = await started(aiohttp_client, max_body_bytes=1000)
    resp = await client.post("/v1/completions", json={"prompt": "x" * 5000})
    assert resp.status == 413
    assert_error_shape(await resp.json())
    resp = await client.get("/nope")
    assert resp.status == 404 and resp.headers["x-worker-id"] == "sim-test"
    assert_error_shape(await resp.json())


async def test_models_info_metrics_flush(aiohttp_client: MakeClient) -> None:
    client = await started(aiohttp_client)
    models = await (await client.get("/v1/models")).json()
    assert models["data"][0]["id"] == "sim" and models["data"][0]["max_model_len"] > 0
    await client.post("/v1/completions", json={"prompt": LONG, "max_tokens": 2})
    info = await (await client.get("/get_server_info")).json()
    assert info["worker_id"] == "sim-test" and info["engine"] == "sim"
    assert info["stats"]["kv_used_tokens"] > 0 and "api_keys" not in info["config"]
    metrics = await (await client.get("/metrics")).text()
    assert 'radix_worker_requests_total{endpoint="/v1/completions",status="200"} 1.0' in metrics
    assert "radix_worker_completion_tokens_total 2.0" in metrics
    assert "radix_worker_preemptions_total 0.0" in metrics
    assert "radix_worker_kv_capacity_tokens 50000.0" in metrics
    assert (await (await client.post("/flush_cache")).json()) == {"flushed": True}
    assert engine_of(client).stats().kv_used_tokens == 0
    again = await client.post("/v1/completions", json={"prompt": LONG, "max_tokens": 2})
    assert (await again.json())["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_openapi_document(aiohttp_client: MakeClient) -> None:
    client = await started(aiohttp_client)
    doc = await (await client.get("/openapi.json")).json()
    assert doc["openapi"].startswith("3.1")
    for path in ("/v1/chat/completions", "/v1/completions", "/generate"):
        op = doc["paths"][path]["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.split("/")[-1] in doc["components"]["schemas"]
        assert "400" in op["responses"]
    text = json.dumps(doc)
    for ref in {part.split('"')[0] for part in text.split('"$ref": "')[1:]}:
        assert ref.split("/")[-1] in doc["components"]["schemas"], ref


async def test_health_draining_and_api_keys(aiohttp_client: MakeClient) -> None:
    client = await started(aiohttp_client, api_keys=["sekret"])
    assert (await client.get("/health")).status == 200
    resp = await client.post("/v1/completions", json={"prompt": "x"})
    assert resp.status == 401 and assert_error_shape(await resp.json())["code"] == "invalid_api_key"
    auth = {"Authorization": "Bearer sekret"}
    assert (await client.post("/v1/completions", json={"prompt": "x"}, headers=auth)).status == 200
    client.app[STATE].draining = True
    assert (await client.get("/health")).status == 503
    resp = await client.post("/v1/completions", json={"prompt": "x"}, headers=auth)
    assert resp.status == 503 and resp.headers["Retry-After"] == "1"


async def test_health_is_503_until_the_engine_is_up(aiohttp_client: MakeClient) -> None:
    gate = asyncio.Event()

    class SlowStart(AsyncEngine):  # the real sim engine, whose start waits for the test
        async def start(self) -> None:
            await gate.wait()
            await super().start()

    config = sim_config()
    base = build_engine(config)
    assert isinstance(base, AsyncEngine)
    app = create_app(config, SlowStart(base.engine, base.model_name))
    client = await aiohttp_client(app)
    assert (await client.get("/health")).status == 503
    resp = await client.post("/v1/completions", json={"prompt": "x"})
    assert resp.status == 503 and assert_error_shape(await resp.json())["code"] == "not_ready"
    gate.set()
    await asyncio.wait_for(app[STATE].ready.wait(), 5)
    assert (await client.get("/health")).status == 200


async def test_queue_full_is_503(aiohttp_client: MakeClient) -> None:
    client = await started(
        aiohttp_client, max_running_requests=1, max_waiting_requests=1, sim_decode_ms_per_token=5
    )
    body = {"prompt": "hold", "max_tokens": 200}
    first = asyncio.create_task(client.post("/v1/completions", json=body))
    second = asyncio.create_task(client.post("/v1/completions", json=body))
    await wait_until(lambda: engine_of(client).stats().waiting == 1)
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 503 and assert_error_shape(await resp.json())["code"] == "overloaded"
    for task in (first, second):
        (await task).close()
    engine_of(client).engine.check_integrity()


async def test_a_chat_prompt_is_tokenized_once(
    aiohttp_client: MakeClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rendered chat prompt is encoded once and sent to the engine as ids (it was
    encoded twice: once to count the room left for max_tokens, once by the engine)."""
    client = await started(aiohttp_client)
    tokenizer = engine_of(client).engine.tokenizer
    calls: list[str] = []
    encode = tokenizer.encode

    def counting(text: str, add_special_tokens: bool = True) -> list[int]:
        calls.append(text)
        return encode(text, add_special_tokens)

    monkeypatch.setattr(tokenizer, "encode", counting)
    messages = [{"role": "user", "content": "how many times am I read?"}]
    resp = await client.post("/v1/chat/completions", json={"messages": messages})
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    assert body["choices"][0]["message"]["content"] and body["usage"]["prompt_tokens"] > 0
    # (The sim engine encodes its own answer text too: only the prompt's encodings count.)
    assert sum("how many times am I read?" in text for text in calls) == 1
