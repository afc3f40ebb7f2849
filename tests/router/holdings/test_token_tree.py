"""With a router `tokenizer`, the policies' trees key on the prompt ids: matches, rates and
caps are in tokens. A real sim worker and the real router app on loopback; the official
openai client. Without a tokenizer nothing changes (test_policy_equivalence.py)."""

from __future__ import annotations

import random

import openai
import pytest

from router.http.state import FLEET, ROUTING
from router.policy import build_routing
from router.policy.base import FleetView, RouteRequest
from shared.config import RouterConfig
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
        # The tree holds token sequences: the root's children are keyed by token ids.
        root = router.app[ROUTING].holdings.tree._root
        assert root.children and all(type(k) is int for k in root.children)
        assert all(type(c.key) is tuple for c in root.children.values())
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
        assert p.holdings.tree._cap["w0"] == 100
        assert (d.matched_chars, d.match_rate, d.predicted_tokens) == (20, 20 / 21, 20.0)
    else:
        assert p.holdings.tree._cap["w0"] == 400
        assert (d.matched_chars, d.match_rate) == (40, 40 / 42)
