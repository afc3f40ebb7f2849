"""The router's tokenizer against prompts of any size (issue 30, finding 2): a cap before
the work, long prompts tokenized off the event loop, a bound on waiting, caches bounded
in bytes. A real router and sim worker over loopback, the official openai client; the
sim tokenizer is wrapped (not replaced) so a test can hold it mid-encode."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp.test_utils import TestServer

from router.http.state import TOKENIZE
from router.http.tokenize import MAX_CHARS_PER_TOKEN, Tokenizing
from shared.config import RouterConfig
from shared.tokens.prompt_tokens import PromptTokens, load_tokenizer
from tests.fuzz.conftest import start_router, start_worker, worker_config

CONTEXT = 2048  # the workers' context length, in tokens
BODY = 1 << 20


class Held:
    """The sim tokenizer, held inside `encode` of any text over `over` characters until
    `go` is set; it records which thread encoded what."""

    def __init__(self, inner: Any, over: int) -> None:
        self.inner, self.over = inner, over
        self.go, self.entered = threading.Event(), threading.Event()
        self.encoded: list[tuple[int, str]] = []  # (characters, thread name)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.encoded.append((len(text), threading.current_thread().name))
        if len(text) > self.over:
            self.entered.set()
            self.go.wait(30)
        return self.inner.encode(text, add_special_tokens=add_special_tokens)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.fixture
async def fleet() -> AsyncIterator[tuple[TestServer, Held]]:
    worker = await start_worker(
        worker_config(max_model_len=CONTEXT, max_body_bytes=BODY, cache_tokens=8192)
    )
    router = await start_router(RouterConfig(
        host="127.0.0.1", worker_urls=(str(worker.make_url("")).rstrip("/"),),
        tokenizer="sim", max_prompt_tokens=CONTEXT, max_body_bytes=BODY, access_log=False,
    ))  # fmt: skip
    tokenize = router.app[TOKENIZE]
    tokenize.inline_chars = 1000
    held = Held(tokenize.tokens.tokenizer, over=1000)
    tokenize.tokens.tokenizer = held
    try:
        yield router, held
    finally:
        held.go.set()
        await router.close()
        await worker.close()


def client(router: TestServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(router.make_url("/v1")), api_key="x", max_retries=0)


async def test_a_long_prompt_is_tokenized_off_the_event_loop(
    fleet: tuple[TestServer, Held],
) -> None:
    router, held = fleet
    prompt = "word " * 300  # 1,500 characters: over the inline bound, under the cap
    request = asyncio.create_task(
        client(router).completions.create(model="sim", prompt=prompt, max_tokens=1)
    )
    await asyncio.to_thread(held.entered.wait, 30)
    timeout = aiohttp.ClientTimeout(10)
    async with (  # the loop answers while the tokenizer is held
        aiohttp.ClientSession() as http,
        http.get(router.make_url("/health"), timeout=timeout) as r,
    ):
        assert r.status == 200
    assert not request.done()
    held.go.set()
    answer = await request
    assert answer.usage.prompt_tokens > 0
    assert [t for n, t in held.encoded if n > 1000] == ["tokenize_0"]


async def test_a_short_prompt_is_tokenized_inline(fleet: tuple[TestServer, Held]) -> None:
    """Under the inline bound a prompt is tokenized on the event loop's own thread
    (`Tokenizing.now`): no hand-off to the tokenizer thread, no await."""
    router, held = fleet
    api = client(router)
    await api.completions.create(model="sim", prompt="word " * 20, max_tokens=1)
    messages = [{"role": "user", "content": "Hello there?"}]
    await api.chat.completions.create(model="sim", messages=messages, max_tokens=1)  # type: ignore[arg-type]
    here = threading.current_thread().name
    assert held.encoded and {t for _, t in held.encoded} == {here}


async def test_past_the_waiting_bound_a_prompt_is_routed_on_its_text(
    fleet: tuple[TestServer, Held],
) -> None:
    router, held = fleet
    tokenize: Tokenizing = router.app[TOKENIZE]
    tokenize.max_waiting = 1
    api = client(router)
    first = asyncio.create_task(
        api.completions.create(model="sim", prompt="word " * 300, max_tokens=1)
    )
    await asyncio.to_thread(held.entered.wait, 30)
    second = await api.completions.create(model="sim", prompt="other " * 300, max_tokens=1)
    assert second.usage.prompt_tokens > 0 and not first.done()  # answered meanwhile
    assert tokenize.skipped == {"busy": 1}
    held.go.set()
    await first


async def test_a_prompt_past_the_cap_is_never_tokenized_and_the_worker_refuses_it(
    fleet: tuple[TestServer, Held],
) -> None:
    router, held = fleet
    cap = CONTEXT * MAX_CHARS_PER_TOKEN
    prompt = "x " * (cap // 2 + 100)  # over the cap: cannot fit the worker's context
    with pytest.raises(openai.BadRequestError) as refused:
        await client(router).completions.create(model="sim", prompt=prompt, max_tokens=1)
    assert "context length" in str(refused.value)  # the worker's own 400, in its words
    assert router.app[TOKENIZE].skipped == {"too_long": 1}
    assert all(n <= cap for n, _ in held.encoded)


def test_the_prompt_caches_are_bounded_in_bytes() -> None:
    """Three 10 MB prompts left 2.3 GB of piece text held when idle: a count of ids
    alone did not see the text."""
    tokens = PromptTokens(load_tokenizer("sim"), max_bytes=1 << 20)
    for i in range(40):  # 40 distinct pieces of ~60 KB characters each
        tokens.text(f"{i} " + "abc " * 15_000)
        assert tokens.held_bytes <= 1 << 20
    huge = "zzz " * 200_000  # one piece over max_bytes / 16: encoded, never kept
    assert len(tokens.text(huge)) > 0
    assert huge not in tokens._pieces and tokens.held_bytes <= 1 << 20


async def test_a_prompt_that_cannot_fit_is_refused_by_the_router(tiny_model_dir) -> None:
    """Longer than the context × the tokenizer's longest token: no tokenization can make
    it fit, so the router answers vLLM's 400 itself, and no worker reads 10 MB."""
    worker = await start_worker(worker_config(max_body_bytes=BODY))
    router = await start_router(RouterConfig(
        host="127.0.0.1", worker_urls=(str(worker.make_url("")).rstrip("/"),),
        tokenizer=str(tiny_model_dir), max_prompt_tokens=64, max_body_bytes=BODY,
        access_log=False,
    ))  # fmt: skip
    try:
        tokenize: Tokenizing = router.app[TOKENIZE]
        longest = tokenize.longest_token_chars
        assert longest is not None and tokenize.refuse_chars == 64 * longest
        api = client(router)
        with pytest.raises(openai.BadRequestError) as refused:
            await api.chat.completions.create(
                model="sim", max_tokens=1,
                messages=[{"role": "user", "content": "y" * (64 * longest + 1)}],
            )  # fmt: skip
        body = refused.value.body
        assert body["code"] == "context_length_exceeded" and body["param"] == "messages"  # type: ignore[index]
        assert "64 tokens" in body["message"]  # type: ignore[index]
        assert tokenize.skipped == {"refused": 1}
        answer = await api.completions.create(model="sim", prompt="a short one", max_tokens=1)
        assert answer.usage.prompt_tokens > 0  # type: ignore[union-attr]
    finally:
        await router.close()
        await worker.close()
