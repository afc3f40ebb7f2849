"""The holdings room: one prediction per request, keyed by the request's cache namespace,
told what was routed, what other replicas routed and what answers reported.

The real room, tree, feed and index; the real policies through `Routing`; the real
fleet table telling the room. No Redis (stream entries are applied as the reader
applies them; replica sync's wire form is encoded and decoded for real).
"""

from __future__ import annotations

import random

from router.fleet.table import Fleet
from router.fleet.view import FleetView
from router.holdings.kv_feed import FeedMember, KvEventFeed, StreamState
from router.holdings.kv_index import BlockIndex
from router.holdings.namespace import DEFAULT, namespace_of, request_namespace
from router.holdings.prediction import Holding, RouteRequest
from router.holdings.room import Holdings
from router.holdings.sync_wire import decode_decision, encode_decision, encode_tokens
from router.policy import build_routing
from shared.config import RouterConfig
from shared.wire.kv_events import AllBlocksCleared, BlockStored
from shared.wire.protocol import ChatCompletionRequest, CompletionRequest
from shared.wire.registry import WorkerRecord

SYSTEM = "You are a careful assistant. " * 8  # 232 chars
FLEET = FleetView(["w0", "w1", "w2"])


def salted(text: str, salt: str | None, model: str = "m") -> RouteRequest:
    return RouteRequest(text, model=model, namespace=namespace_of(model, salt))


def test_the_prediction_names_each_holder_and_why() -> None:
    """Worked example: w0 was routed the system prompt (tree); w1 reports its first two
    blocks (index); w2 both. Units are tokens (the router tokenizes)."""
    feed = KvEventFeed(registry=None)  # type: ignore[arg-type]  # entries applied by hand
    index = feed.indexes["m"] = BlockIndex(4)
    ids = tuple(range(100, 116))
    for w, blocks in (("w1", 2), ("w2", 4)):
        feed.streams[w] = StreamState("m", 1.0, status="ok")
        index.apply(w, [BlockStored(tuple(range(1, blocks + 1)), None, ids[: 4 * blocks], 4)])
    room = Holdings(RouterConfig(tokenizer="sim", kv_events_inflight=2.0), feed)
    for w in ("w0", "w2"):
        room.observe(w, ids[:12], now=9.5)  # in flight: the index cannot show it yet
    prediction = room.predict(RouteRequest("", tokens=(*ids, 7), model="m"), FLEET, 10.0)
    assert prediction.holdings() == {
        "w0": Holding(12, 0, "tree"),
        "w1": Holding(8, 0, "index"),
        "w2": Holding(16, 0, "both"),
    }
    assert prediction.priced_tiers == {"w1", "w2"}


def test_no_hit_is_predicted_across_cache_salts() -> None:
    """The same prompt under another salt (or none) shares no blocks in the engine: the
    room predicts none there, on text and on prompt ids alike; under the same salt it
    predicts the whole prompt. Today's router predicted the whole prompt for every salt."""
    for config, ids in ((RouterConfig(), None), (RouterConfig(tokenizer="sim"), range(300))):
        routing = build_routing(config, random.Random(0))
        room = routing.holdings
        tokens = tuple(ids) if ids is not None else None

        def req(salt: str | None, tokens: tuple[int, ...] | None = tokens) -> RouteRequest:
            return RouteRequest(SYSTEM, tokens=tokens, model="m",
                                namespace=namespace_of("m", salt))  # fmt: skip

        assert routing.select(req("tenant-a"), FLEET, 0.0).reason == "no_match"
        holder = room.predict(req("tenant-a"), FLEET, 1.0).holdings()
        assert [h.device for h in holder.values()] == [len(tokens or SYSTEM)]
        for other in ("tenant-b", None):
            assert room.predict(req(other), FLEET, 1.0).path == []


def test_a_partial_match_of_another_namespaces_tag_counts_for_nothing() -> None:
    """Namespace tags share their leading bytes (NUL "ns:" ...): a match that ends inside
    the tag is not a hit, and lengths are the request's own."""
    room = build_routing(RouterConfig(), random.Random(0)).holdings
    a, b = salted(SYSTEM, "a"), salted(SYSTEM, "b")
    room.routed(room.predict(a, FLEET, 0.0), "w0", 0.0)
    assert room.predict(b, FLEET, 1.0).path == []
    assert [end for _, end in room.predict(a, FLEET, 1.0).path] == [len(SYSTEM)]


def test_replicas_file_a_namespaced_decision_under_its_namespace() -> None:
    """Replica sync carries the key the tree keyed on (tag included), so a replica's
    room predicts the hit under the same salt only; token tags stay in the id range the
    wire carries."""
    sent = []
    routing = build_routing(RouterConfig(), random.Random(0), publish=lambda w, k: sent.append(k))
    routing.select(salted(SYSTEM, "a"), FLEET, 0.0)
    wid, key = decode_decision(encode_decision(b"r1\x00", "w1", sent[0], 10_000), 10_000)
    replica = build_routing(RouterConfig(), random.Random(0)).holdings
    replica.observe(wid, key, now=1.0)
    assert replica.predict(salted(SYSTEM, "a"), FLEET, 2.0).held("w1") == len(SYSTEM)
    assert replica.predict(salted(SYSTEM, None), FLEET, 2.0).path == []
    on_ids = build_routing(
        RouterConfig(tokenizer="sim"), random.Random(0), publish=lambda w, k: sent.append(k)
    )
    on_ids.select(
        RouteRequest("", tokens=tuple(range(50)), namespace=namespace_of("m", "a")), FLEET, 0.0
    )
    assert encode_tokens(b"r1\x00", "w1", sent[-1], "f" * 16, 10_000) is not None


def test_a_requests_namespace_comes_from_its_salt_and_template() -> None:
    plain = CompletionRequest(prompt="x", model="m")
    assert request_namespace(plain) == DEFAULT
    keys = {
        request_namespace(CompletionRequest(prompt="x", model=model, cache_salt=salt))
        for model in ("m", "lora-a") for salt in ("s1", "s2")
    }  # fmt: skip
    assert len(keys) == 4 and DEFAULT not in keys
    chat = {"messages": [{"role": "user", "content": "x"}], "model": "m"}
    templated = ChatCompletionRequest.model_validate({**chat, "chat_template_kwargs": {"t": 1}})
    assert request_namespace(templated) not in (DEFAULT, request_namespace(
        ChatCompletionRequest.model_validate({**chat, "chat_template_kwargs": {"t": 2}})))  # fmt: skip
    # Routing on text the router renders nothing: the template is the engine's business.
    assert request_namespace(templated, renders=False) == DEFAULT


def test_a_worker_that_changes_model_loses_its_tree() -> None:
    """Its cache held the other model's blocks: the room forgets it, and the policy's
    own books follow at the next prediction."""
    routing = build_routing(RouterConfig(policy="cost_aware"), random.Random(0))
    fleet = Fleet(RouterConfig(), routing.holdings)
    record = WorkerRecord("w0", "http://127.0.0.1:9000", "m", "sim", 1.0)
    fleet.apply_registry({"w0": record})
    routing.holdings.observe("w0", SYSTEM, now=0.0)
    fleet.apply_registry({"w0": WorkerRecord("w0", "http://127.0.0.1:9000", "n", "sim", 1.0)})
    assert routing.holdings.worker_stats() == {}
    assert routing.holdings.predict(RouteRequest(SYSTEM), FLEET, 1.0).forgotten == ("w0",)


def pre_claimed(answers: bool, liar: bool = True) -> list[str]:
    """Where 20 requests for a prefix go when w2's KV events claim it (no route sent it
    there: a pre-claim) and w2's answers report `cached_tokens` 0 (`liar`) or what was
    predicted. `answers`: the fleet tells the room what each answer reported."""
    prefix = tuple(range(1000, 2024))  # 64 blocks of 16
    feed = KvEventFeed(registry=None)  # type: ignore[arg-type]
    index = feed.indexes["m"] = BlockIndex(16)
    for w in ("w0", "w1", "w2"):
        feed.streams[w] = StreamState("m", 1.0, status="ok")
    index.apply("w2", [BlockStored(tuple(range(1, 65)), None, prefix, 16)])
    config = RouterConfig(tokenizer="sim")
    routing = build_routing(config, random.Random(0), feed=feed)
    fleet = Fleet(config, routing.holdings)
    for w in ("w0", "w1", "w2"):
        fleet.add_url(f"http://127.0.0.1:{9000 + int(w[1])}", "static", w)
    went = []
    for i in range(20):
        now = 10.0 + i
        view = fleet.view(now)
        d = routing.select(RouteRequest("", tokens=(*prefix, 5000 + i), model="m"), view, now)
        went.append(d.worker_id)
        with fleet.attempt(fleet.workers[d.worker_id], now) as attempt:
            cached = 0 if (d.worker_id == "w2" and liar) else int(d.predicted_tokens or 0)
            if answers:
                fleet.succeeded(attempt, d.predicted_tokens or 0.0, cached, now=now)
    return went


def test_a_worker_whose_claimed_hits_do_not_come_true_stops_drawing_the_traffic() -> None:
    """Issue 30, finding 5: a worker pre-claimed a prefix nobody held and drew 20 of 20
    requests for it. Its answers reported 0 cached tokens against 1,024 predicted: after
    MIN_ANSWERS of them (router/holdings/claims.py) its claims count for nothing and the
    prefix goes to an honest worker, which keeps it. An honest holder is never
    discounted."""
    assert pre_claimed(answers=False).count("w2") == 20  # the room not told: the incident
    went = pre_claimed(answers=True)
    assert went[:3] == ["w2"] * 3 and "w2" not in went[3:]
    assert len(set(went[3:])) == 1  # the honest worker that took it over keeps it
    assert pre_claimed(answers=True, liar=False).count("w2") == 20


def test_the_index_keeps_salted_blocks_out_of_the_default_namespace() -> None:
    """Our engine and vLLM write a salted prompt's salt into its first block's
    `extra_keys`. Those blocks (and the ones stored below them) never reach the index:
    the same prompt unsalted is no predicted hit there, the unsalted copy is."""
    from shared.wire.kv_events import encode_batch, entry_fields

    ids = tuple(range(100, 132))  # 8 blocks of 4
    salted = [
        BlockStored((1, 2), None, ids[:8], 4, extra_keys=(("tenant-a",), None)),
        BlockStored((3,), 2, ids[8:12], 4),
    ]  # a later turn's block below them
    plain = [BlockStored((11, 12), None, ids[:8], 4)]
    feed = KvEventFeed(registry=None, block_size=4)  # type: ignore[arg-type]
    feed.follow([FeedMember("w0", "m", 1.0), FeedMember("w1", "m", 1.0)])
    for wid, events in (("w0", salted), ("w1", plain)):
        raw = entry_fields(wid, 1.0, 0, encode_batch([AllBlocksCleared(), *events]))
        feed.apply_entry(wid, {k.encode(): v if isinstance(v, bytes) else v.encode()
                               for k, v in raw.items()})  # fmt: skip
    assert feed.match("m", ids) == {"w1": 8}
    room = Holdings(RouterConfig(tokenizer="sim"), feed)
    assert room.predict(RouteRequest("", tokens=ids, model="m"), FLEET, 1.0).holdings() == {
        "w1": Holding(8, 0, "index")
    }
