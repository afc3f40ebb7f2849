"""SSE streaming at low CPU per token: plain deltas from a per-stream template, and the
outputs a stream finds waiting together sent as one delta in one write, the client's
answer unchanged (worker/http/streaming.py, worker/engine/mailbox.py)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from shared.serving.http import DeadlineStream
from shared.wire import openai_responses as wire
from tests.worker.http.test_app import LONG, MakeClient, engine_of, sse_events, started
from worker.http.formats import ChatFormat, CompletionFormat
from worker.http.streaming import DeltaEvents, encode_event

TEXTS = [
    "",
    " word",
    'quote " and \\ back',
    "line\nbreak\ttab",
    "€ and 😀",
    "\x00\x1f",
    "</script>",
]


@pytest.mark.parametrize("index", [0, 3])
def test_delta_events_are_byte_for_byte_the_encoded_chunks(index: int) -> None:
    def chunk(i: int, text: str) -> dict[str, Any]:
        choice = wire.choice(i, {"delta": {"content": text}}, None)
        return wire.envelope("chat.completion.chunk", "chatcmpl-1", "m", 5, [choice])

    events = DeltaEvents(chunk)
    for text in TEXTS:
        assert events.event(index, text) == encode_event(chunk(index, text))


def test_a_model_name_holding_the_placeholder_falls_back_to_encoding() -> None:
    fmt = ChatFormat("chatcmpl-1", "odd\x00delta\x00name", False, lambda ids: [])
    event = fmt._plain.event(0, "hi")
    assert event == encode_event(fmt._chunk(0, {"content": "hi"}))


def test_completion_plain_chunks_match_the_generic_chunk() -> None:
    fmt = CompletionFormat("cmpl-1", "m", "", False, lambda ids: [])
    for text in TEXTS:
        choice = fmt._choice(1, text, [], None)
        generic = wire.envelope("text_completion", "cmpl-1", "m", fmt.created, [choice])
        assert fmt._plain.event(1, text) == encode_event(generic)


async def stream(client: Any, path: str, body: dict[str, Any], block_s: float) -> list[Any]:
    """The SSE events; after the first, the server's loop (the test's) is blocked for
    `block_s`, so the engine finishes the answer while the handler cannot send it."""
    resp = await client.post(path, json={**body, "stream": True})
    assert resp.status == 200
    first = await resp.content.readuntil(b"\n\n")
    time.sleep(block_s)  # blocking the loop is the point
    return [json.loads(first.removeprefix(b"data: ")), *await sse_events(resp)]


def answer(events: list[Any], key: str) -> tuple[dict[int, str], dict[int, str], Any]:
    """Per choice the text and finish reason, and the usage: what a client assembles."""
    assert events[-1] == "[DONE]"
    text: dict[int, str] = {}
    finish: dict[int, str] = {}
    for e in events[:-2]:
        for c in e["choices"]:
            part = c[key] if key == "text" else c["delta"].get("content", "")
            text[c["index"]] = text.get(c["index"], "") + part
            assert c["index"] not in finish, "nothing follows a choice's finish"
            if c["finish_reason"]:
                finish[c["index"]] = c["finish_reason"]
    return text, finish, events[-2]["usage"]


@pytest.mark.parametrize(
    ("path", "body", "key"),
    [
        ("/v1/completions", {"prompt": LONG, "n": 2}, "text"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, "delta"),
    ],
)
async def test_outputs_waiting_together_leave_in_one_write(
    aiohttp_client: MakeClient, monkeypatch: pytest.MonkeyPatch, path: str, body: dict, key: str
) -> None:
    client = await started(aiohttp_client, sim_decode_ms_per_token=2.0)
    writes: list[bytes] = []
    write, write_eof = DeadlineStream.write, DeadlineStream.write_eof

    async def counted_write(self: DeadlineStream, data: bytes) -> None:
        writes.append(bytes(data))
        await write(self, data)

    async def counted_eof(self: DeadlineStream, data: bytes = b"") -> None:
        if data:  # aiohttp ends every response with an empty write_eof(): no write
            writes.append(bytes(data))
        await write_eof(self, data)

    monkeypatch.setattr(DeadlineStream, "write", counted_write)
    monkeypatch.setattr(DeadlineStream, "write_eof", counted_eof)
    body = {**body, "max_tokens": 30, "stream_options": {"include_usage": True}}
    # First the whole answer (it also caches the prompt, so both streams hit the cache).
    plain = await (await client.post(path, json={**body, "stream": False})).json()
    stepwise = await stream(client, path, body, 0)
    stepwise_writes, writes[:] = len(writes), []
    piled = await stream(client, path, body, 0.5)  # 30 steps of 2 ms pile up meanwhile
    # The first write carried the first output; everything after it left in one.
    assert len(writes) == 2 < stepwise_writes
    assert answer(piled, key) == answer(stepwise, key)
    text, finish, usage = answer(piled, key)
    n = body.get("n", 1)
    assert finish == dict.fromkeys(range(n), "length") and usage["completion_tokens"] == 30 * n
    whole = {
        c["index"]: c.get("text", c.get("message", {}).get("content")) for c in plain["choices"]
    }
    assert text == whole


async def test_deltas_ready_before_an_engine_failure_still_reach_the_client(
    aiohttp_client: MakeClient,
) -> None:
    client = await started(aiohttp_client, sim_decode_ms_per_token=2.0)
    runner = engine_of(client).engine.runner
    forward, steps = runner.forward, 0

    def fails_at_step_10(batch: Any) -> Any:
        nonlocal steps
        steps += 1
        if steps == 10:
            raise RuntimeError("device lost")
        return forward(batch)

    runner.forward = fails_at_step_10  # fault injection on this instance only
    body = {"prompt": LONG, "max_tokens": 30}
    events = await stream(client, "/v1/completions", body, 0.5)  # steps 2-9 and the error pile up
    del runner.forward
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["type"] == "server_error" and "device lost" in error["message"]
    deltas = [e["choices"][0]["text"] for e in events[:-2]]
    assert len(deltas) == 2 and all(deltas)  # the first token, then steps 2-9 merged
    again = await (await client.post("/v1/completions", json=body)).json()
    assert again["choices"][0]["text"].startswith("".join(deltas))  # the same answer
