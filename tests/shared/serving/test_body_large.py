"""Large request bodies (issue 30, finding 2): parsed with the event loop free between
slices, one at a time per loop, the others waiting their turn; the answers are the small
path's. A real aiohttp server over loopback where a request goes through `read_json`."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from shared.serving import body
from shared.serving.body import (
    LARGE_BODY_BYTES,
    SLICE_BYTES,
    parse_json_object,
    parse_large,
    read_json,
)
from shared.serving.errors import APIError, error_response

SIZE = 3 * SLICE_BYTES + 100


def padded(tail: str, at: int) -> bytes:
    """A JSON object whose `tail` text starts at byte `at` of the body."""
    head = '{"model": "m", "pad": "'
    pad = "x" * (at - len(head) - len('", "t": '))
    raw = f'{head}{pad}", "t": {tail}, "more": "{"y" * 1000}"}}'.encode()
    assert raw.index(tail.encode()) == at
    return raw


async def turns_while(work: asyncio.Future) -> int:
    turns = 0
    while not work.done():
        turns += 1
        await asyncio.sleep(0)
    return turns


async def test_a_large_body_is_parsed_with_the_loop_free_between_slices() -> None:
    raw = json.dumps({"prompt": "lorem ipsum " * (SIZE // 12)}).encode()
    assert len(raw) > LARGE_BODY_BYTES
    work = asyncio.ensure_future(parse_large(raw))
    turns = await turns_while(work)
    assert work.result() == json.loads(raw)
    assert turns >= 2 * (len(raw) // SLICE_BYTES)  # two byte checks, a turn a slice each


@pytest.mark.parametrize("straddle", [-10, -1, 0, 1])
async def test_a_long_integer_across_a_slice_boundary_is_still_refused(straddle: int) -> None:
    raw = padded("1" * 25, 2 * SLICE_BYTES + straddle - 12)  # the run spans the boundary
    with pytest.raises(APIError) as small:
        parse_json_object(raw)
    with pytest.raises(APIError) as large:
        await parse_large(raw)
    assert large.value.status == small.value.status == 400
    assert large.value.param == small.value.param == "t"


@pytest.mark.parametrize("straddle", [-3, -2, -1, 0])
async def test_a_lone_surrogate_across_a_slice_boundary_is_still_refused(straddle: int) -> None:
    raw = padded('"\\ud800"', SLICE_BYTES + straddle - 1)  # `"` then \ud800 over the cut
    with pytest.raises(APIError) as large:
        await parse_large(raw)
    assert large.value.status == 400 and large.value.param == "t"


async def test_large_bodies_wait_their_turn_and_a_small_one_does_not() -> None:
    """Load never answers 503: past any number waiting, a large body is parsed in turn,
    and a small body is parsed at once while the large ones wait."""
    raw = json.dumps({"prompt": "x" * LARGE_BODY_BYTES}).encode()
    gate = body._GATES.setdefault(asyncio.get_running_loop(), asyncio.Semaphore(1))
    await gate.acquire()  # one large body being parsed
    waiting = [asyncio.ensure_future(parse_large(raw)) for _ in range(20)]
    await asyncio.sleep(0)
    assert not any(w.done() for w in waiting)
    assert parse_json_object(b'{"prompt": "small"}') == {"prompt": "small"}
    gate.release()
    assert all(r["prompt"] == "x" * LARGE_BODY_BYTES for r in await asyncio.gather(*waiting))
    assert not gate.locked()


@pytest.fixture
async def echo() -> AsyncIterator[TestServer]:
    async def handler(request: web.Request) -> web.Response:
        try:
            _, data = await read_json(request, 16 << 20, 10.0)
        except APIError as e:
            return error_response(e)
        return web.json_response({"keys": sorted(data), "chars": len(data.get("prompt", ""))})

    app = web.Application(client_max_size=32 << 20)
    app.router.add_post("/", handler)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield server
    await server.close()


async def test_large_bodies_sent_at_once_are_all_answered(echo: TestServer) -> None:
    prompt = "lorem ipsum dolor " * 300_000  # 5.4 MB each
    raw = json.dumps({"model": "m", "prompt": prompt}).encode()
    async with aiohttp.ClientSession() as http:

        async def send() -> tuple[int, dict]:
            async with http.post(echo.make_url("/"), data=raw) as r:
                return r.status, await r.json()

        answers = await asyncio.gather(*(send() for _ in range(4)))
        bad = raw.replace(b'"m"', b'"\\udfff"')
        async with http.post(echo.make_url("/"), data=bad) as r:
            error = await r.json()
    assert answers == [(200, {"keys": ["model", "prompt"], "chars": len(prompt)})] * 4
    assert r.status == 400 and error["error"]["param"] == "model"
