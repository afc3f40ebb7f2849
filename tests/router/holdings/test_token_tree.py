"""With a router `tokenizer`, the policies' trees key on the prompt ids: matches, rates and
caps are in tokens. A real sim worker and the real router app on loopback; the official
openai client. Without a tokenizer nothing changes (test_policy_equivalence.py)."""

from __future__ import annotations

import random

import numpy as np
import openai
import pytest

from router.http import handlers
from router.http.state import FLEET, ROUTING
from router.policy import build_routing
from router.policy.base import FleetView, RouteRequest
from shared.config import RouterConfig
from shared.tokens.prompt_ids import token_key
from shared.tokens.prompt_tokens import PromptTokens
from shared.wire import protocol
from shared.wire.plain_body import chat_text
from shared.wire.protocol import ChatCompletionRequest, canonical_chat_text
from tests.fuzz.conftest import start_router, start_worker, worker_config

SYSTEM = "You keep the warehouse books: answer in one short sentence, with the figure. " * 8


@pytest.mark.parametrize("policy", ["cache_aware", "cost_aware"])
async def test_second_turn_predicted_in_the_tokens_the_worker_reports(policy: str) -> None:
    worker = await start_worker(worker_config())
    url = str(worker.make_url("")).rstrip("/")
    router = await start_router(RouterConfig(
        host="127.0.0.1", worker_urls=(url,), policy=policy, tokenizer="sim", access_log=False,
    ))  # fmt: skip
    client = openai.AsyncOpenAI(base_url=str(router.make_url("/v1")), api_key="x", max_retries=0)
    try:
        turn = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Boxes?"}]
        # One generated token: the worker caches its reply's KV too, which the tree (it
        # holds what was sent) cannot know, so a longer reply is cached beyond the guess.
        first = await client.chat.completions.create(model="sim", messages=turn, max_tokens=1)
        turn += [
            {"role": "assistant", "content": first.choices[0].message.content or ""},
            {"role": "user", "content": "And pallets?"},
        ]
        raw = await client.chat.completions.with_raw_response.create(
            model="sim", messages=turn, max_tokens=4
        )
        usage = raw.parse().usage
        assert usage is not None and usage.prompt_tokens_details is not None
        cached = usage.prompt_tokens_details.cached_tokens or 0
        predicted = int(raw.headers["x-radix-matched-chars"])  # tokens, on a token tree
        page = 1  # the sim worker's default page_size
        assert cached > 100 and abs(predicted - cached) <= page, (predicted, cached)
        w = router.app[FLEET].workers[next(iter(router.app[FLEET].workers))]
        assert abs(w.predicted_tokens_total - w.actual_cached_tokens_total) <= page
        # The tree holds token keys: the ids' bytes, 4 chars an id (shared/tokens/prompt_ids.py),
        # the first turn's ids from the root down.
        tree = router.app[ROUTING].holdings.tree
        (child,) = tree._root.children.values()
        whole = child.key[: len(child.key) // 4 * 4]
        held = np.frombuffer(whole.encode("latin-1"), "<u4").tolist()
        assert tree.width == 4 and len(held) > 100
        assert held == list(PromptTokens.load("sim").chat(turn[:2]))[: len(held)]
    finally:
        await client.close()
        await router.close()
        await worker.close()


@pytest.mark.parametrize(("policy", "renders"), [("cache_aware", 0), ("consistent_hash", 2)])
async def test_a_chat_routed_on_its_ids_renders_its_routing_text_only_when_read(
    policy: str, renders: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a token tree a chat's routing text is read only by fallbacks, so the handler
    defers it (router/holdings/prediction.py `RouteRequest`): cache_aware routes both
    turns on their ids and never renders it; consistent_hash, which hashes the text,
    gets it rendered (once a request) and the same text as ever."""
    calls: list[str] = []

    def counting(render):  # type: ignore[no-untyped-def]
        def counted(messages):  # type: ignore[no-untyped-def]
            calls.append(text := render(messages))
            return text

        return counted

    # The model's (routing_text's) and the hand-checked body's (the handler's).
    monkeypatch.setattr(protocol, "canonical_chat_text", counting(canonical_chat_text))
    monkeypatch.setattr(handlers, "chat_text", counting(chat_text))
    worker = await start_worker(worker_config())
    url = str(worker.make_url("")).rstrip("/")
    router = await start_router(RouterConfig(
        host="127.0.0.1", worker_urls=(url,), policy=policy, tokenizer="sim", access_log=False,
    ))  # fmt: skip
    client = openai.AsyncOpenAI(base_url=str(router.make_url("/v1")), api_key="x", max_retries=0)
    try:
        turn = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Boxes?"}]
        first = await client.chat.completions.create(model="sim", messages=turn, max_tokens=1)
        turn += [
            {"role": "assistant", "content": first.choices[0].message.content or ""},
            {"role": "user", "content": "And pallets?"},
        ]
        await client.chat.completions.create(model="sim", messages=turn, max_tokens=1)
        assert len(calls) == renders
        if renders:
            assert calls[-1] == canonical_chat_text(
                ChatCompletionRequest.model_validate({"messages": turn}).messages
            )
    finally:
        await client.close()
        await router.close()
        await worker.close()


@pytest.mark.parametrize("policy", ["cache_aware", "cost_aware"])
@pytest.mark.parametrize("tokenizer", [None, "sim"])
def test_tree_cap_and_match_rate_units(policy: str, tokenizer: str | None) -> None:
    config = RouterConfig(policy=policy, tokenizer=tokenizer, tree_chars_per_token=4.0)
    p = build_routing(config, random.Random(0))
    fleet = FleetView(["w0"], capacities=[100])
    text = "abcd" * 20
    ids = tuple(range(1000, 1040))  # 40 "tokens" for 80 chars
    p.select(RouteRequest(text, tokens=ids), fleet, 1.0)
    d = p.select(RouteRequest(text[:40] + "zz", tokens=(*ids[:20], 7)), fleet, 2.0)
    if tokenizer:  # in tokens: no chars-per-token conversion anywhere
        assert p.holdings.tree._cap["w0"] == 100 * 4  # in chars: 4 an id
        assert (d.matched_chars, d.match_rate, d.predicted_tokens) == (20, 20 / 21, 20.0)
    else:
        assert p.holdings.tree._cap["w0"] == 400
        assert (d.matched_chars, d.match_rate) == (40, 40 / 42)


def test_text_in_a_tree_on_ids_never_matches_ids() -> None:
    """A request the router has no ids for (too long to tokenize, the tokenizer busy) is
    keyed by its text's bytes behind TEXT_IN_IDS: ids with those bytes share nothing with
    it, and its lengths are its bytes at 4 a token."""
    p = build_routing(RouterConfig(tokenizer="sim"), random.Random(0))
    fleet = FleetView(["w0", "w1"], capacities=[10_000, 10_000])
    text = "routed on its text alone"
    as_ids = list(np.frombuffer(text.encode()[:24], "<u4").tolist())  # the same bytes
    p.select(RouteRequest(text, tokens=as_ids), fleet, 1.0)
    first = p.holdings.tree.match(token_key(as_ids))  # type: ignore[arg-type]
    prediction = p.holdings.predict(RouteRequest(text, tokens=None), fleet, 2.0)
    assert first and prediction.path == []  # the same bytes as ids: no match
    d = p.select(RouteRequest(text, tokens=None), fleet, 3.0)
    longer = text + " and then some more"
    again = p.holdings.predict(RouteRequest(longer, tokens=None), fleet, 4.0)
    assert again.length == len(longer) // 4
    assert again.holdings()[d.worker_id].device == len(text) // 4
    # A client's ids that are no token ids are keyed the same way (not raised on).
    p.select(RouteRequest("ids", tokens=[-5, 2**40]), fleet, 5.0)
