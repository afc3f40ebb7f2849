"""LoRA adapters in the holdings room: vLLM serves each adapter under its own `model`
name on its base model's workers and keeps its blocks apart (the adapter's name is in
every block's hash), so the router keys an adapter's requests in a namespace of their
own (router/holdings/namespace.py) and keeps its KV events out of the base model's index.
A real vLLM (CPU) shows the same end to end: tests/e2e/test_attach_vllm_events.py."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest

from router.fleet.table import Fleet
from router.fleet.view import FleetView
from router.holdings.kv_feed import FeedMember, KvEventFeed
from router.holdings.namespace import DEFAULT, request_namespace
from router.holdings.prediction import Holding, RouteRequest
from router.holdings.room import Holdings
from router.policy import build_routing
from shared.config import RouterConfig
from shared.wire.kv_events import AllBlocksCleared, BlockStored, encode_batch, entry_fields
from shared.wire.protocol import ChatCompletionRequest, CompletionRequest
from shared.wire.registry import WorkerRecord

SYSTEM = "You are a careful assistant. " * 8


def shared_fleet() -> Fleet:
    """w0 serves `base` and two adapters (one vLLM, `--lora-modules`); w1 `base` only."""
    routing = build_routing(RouterConfig(), random.Random(0))
    fleet = Fleet(RouterConfig(), routing.holdings)
    url = "http://127.0.0.1:{}".format
    fleet.apply_registry({
        "w0": WorkerRecord("w0", url(9000), "base", "vllm", 1.0, adapters=("lora-a", "lora-b")),
        "w1": WorkerRecord("w1", url(9001), "base", "vllm", 1.0),
    })  # fmt: skip
    return fleet


def test_an_adapter_routes_to_the_workers_that_serve_it() -> None:
    fleet = shared_fleet()
    now = 1.0
    assert list(fleet.view(now, "lora-a").ids) == ["w0"]
    assert list(fleet.view(now, "base").ids) == ["w0", "w1"]
    assert fleet.knows_model("lora-b") and not fleet.knows_model("lora-c")
    assert fleet.serves_adapter("lora-a") and not fleet.serves_adapter("base")
    assert fleet.models() == {"base": None, "lora-a": "base", "lora-b": "base"}  # /v1/models
    # An adapter dropped from the heartbeat stops drawing its traffic there.
    fleet.apply_registry({"w0": WorkerRecord("w0", "http://127.0.0.1:9000", "base", "vllm", 1.0)})
    assert not fleet.knows_model("lora-a") and not fleet.serves_adapter("lora-a")


def test_a_base_models_name_listed_as_an_adapter_stays_a_base_model() -> None:
    """A worker credential that lists `base` among its adapters would otherwise key every
    `base` request apart (off the KV-event index) fleet-wide; a name some worker serves
    as its base model is never keyed as an adapter."""
    fleet = shared_fleet()
    url = "http://127.0.0.1:9002"
    fleet.apply_registry({
        **{w.worker_id: w.report for w in fleet.workers.values()},
        "w2": WorkerRecord("w2", url, "other", "vllm", 1.0, adapters=("base", "lora-a")),
    })  # fmt: skip
    assert not fleet.serves_adapter("base") and fleet.serves_adapter("lora-a")
    base = CompletionRequest(model="base", prompt="x")
    assert request_namespace(base, True, fleet.serves_adapter("base")) == DEFAULT


def on_one_worker(keyed: bool) -> list[int]:
    """Chars the router predicted held for the same prompt for `base`, `lora-a` twice,
    `lora-b` and `base` again, all on w0 (w1 serves another model here). `keyed`: the
    request's namespace knows the adapter (the handler asks `fleet.serves_adapter`)."""
    routing = build_routing(RouterConfig(), random.Random(0))
    fleet = Fleet(RouterConfig(), routing.holdings)
    fleet.apply_registry({
        "w0": WorkerRecord("w0", "http://127.0.0.1:9000", "base", "vllm", 1.0,
                           adapters=("lora-a", "lora-b")),
        "w1": WorkerRecord("w1", "http://127.0.0.1:9001", "other", "vllm", 1.0),
    })  # fmt: skip
    matched = []
    for now, model in enumerate(("base", "lora-a", "lora-a", "lora-b", "base")):
        adapter = keyed and fleet.serves_adapter(model)
        namespace = request_namespace(CompletionRequest(model=model, prompt=SYSTEM), True, adapter)
        request = RouteRequest(SYSTEM, model=model, namespace=namespace)
        decision = routing.select(request, fleet.view(float(now), model), float(now))
        assert decision.worker_id == "w0"
        matched.append(decision.matched_chars)
    return matched


def test_no_hit_is_predicted_across_adapters_on_a_shared_worker() -> None:
    """One worker serves the base model and two adapters: each adapter's first request
    is predicted nothing (its engine holds nothing of it), its second the whole prompt,
    and the base model keeps its own. Keyed by the model name alone, as the room keyed a
    default namespace before, every one after the first was predicted the whole prompt."""
    whole = len(SYSTEM)
    assert on_one_worker(keyed=True) == [0, 0, whole, 0, whole]
    assert on_one_worker(keyed=False) == [0, whole, whole, whole, whole]


def test_an_adapters_namespace() -> None:
    base = CompletionRequest(model="base", prompt="x")
    lora = CompletionRequest(model="lora-a", prompt="x")
    assert request_namespace(base) == DEFAULT
    assert request_namespace(lora, adapter=True) not in (DEFAULT, request_namespace(
        CompletionRequest(model="lora-b", prompt="x"), adapter=True))  # fmt: skip
    salted = CompletionRequest(model="lora-a", prompt="x", cache_salt="t")
    assert request_namespace(salted, adapter=True) != request_namespace(salted)
    # SGLang names the adapter in the body: keyed too, whatever the fleet knows.
    sglang = CompletionRequest.model_validate({"model": "base", "prompt": "x", "lora_path": "a"})
    assert request_namespace(sglang) not in (DEFAULT, request_namespace(
        CompletionRequest.model_validate({"model": "base", "prompt": "x", "lora_path": "b"})))  # fmt: skip


def test_the_index_keeps_an_adapters_blocks_out_of_its_base_models() -> None:
    """Recorded in vLLM's format: w0 stored the prompt's blocks for an adapter, w1 for
    the base model. Whether the event names the adapter by `lora_name` and `extra_keys`
    (vLLM 0.32) or by `lora_id` alone (an older schema), w0's blocks stay out of the
    base model's index, as do the blocks stored below them; a base request is predicted
    w1's blocks only. (Before, `lora_id` was read and dropped: w0 was predicted 8.)"""
    ids = tuple(range(100, 132))
    forms = {
        "0.32": dict(lora="ad-a", extra_keys=(("ad-a",), ("ad-a",))),
        "lora_id only": dict(lora=1),
    }
    for form, marks in forms.items():
        adapter = [
            BlockStored((1, 2), None, ids[:8], 4, **marks),  # type: ignore[arg-type]
            BlockStored((3,), 2, ids[8:12], 4),
        ]  # a later block stored below them
        plain = [BlockStored((11, 12), None, ids[:8], 4)]
        feed = KvEventFeed(registry=None, block_size=4)  # type: ignore[arg-type]
        feed.follow([FeedMember("w0", "m", 1.0), FeedMember("w1", "m", 1.0)])
        for wid, events in (("w0", adapter), ("w1", plain)):
            raw = entry_fields(wid, 1.0, 0, encode_batch([AllBlocksCleared(), *events]))
            feed.apply_entry(wid, {k.encode(): v if isinstance(v, bytes) else v.encode()
                                   for k, v in raw.items()})  # fmt: skip
        assert feed.match("m", ids) == {"w1": 8}, form
        assert feed.dropped["namespace"] == 1, form
        room = Holdings(RouterConfig(tokenizer="sim"), feed)
        held = room.predict(RouteRequest("", tokens=ids, model="m"), FleetView(["w0", "w1"]), 1.0)
        assert held.holdings() == {"w1": Holding(8, 0, "index")}, form


def test_names_and_templates_past_their_bound_are_keyed_without_digesting_them() -> None:
    """An SGLang `lora_path` is an adapter's name: past MAX_NAME_CHARS (the registry's
    bound on a name) it names none, and digesting it cost the event loop ~75 ms for 15
    MB. Such a request is keyed as TOO_LONG (its text never read), apart from the base
    model's and from every real adapter's."""
    from router.holdings.namespace import MAX_NAME_CHARS

    def ns(lora_path: str) -> str:
        body = {"model": "base", "prompt": "x", "lora_path": lora_path}
        return request_namespace(CompletionRequest.model_validate(body))

    long_a, long_b = "a" * 1_000_000, "b" * (MAX_NAME_CHARS + 1)
    assert ns(long_a) == ns(long_b)  # keyed without its text
    assert ns(long_a) not in (DEFAULT, ns("a"), ns("a" * MAX_NAME_CHARS))
    assert ns("a" * MAX_NAME_CHARS) != ns("b" * MAX_NAME_CHARS)  # a real name: its own key
    # The model (keyed with a salt) and a chat template (where the router renders chats)
    # are bounded the same way (a template at MAX_TEMPLATE_CHARS).
    from router.holdings.namespace import MAX_TEMPLATE_CHARS

    def salted(model: str) -> str:
        return request_namespace(CompletionRequest(model=model, prompt="x", cache_salt="s"))

    assert salted("m" * 1_000_000) == salted("n" * (MAX_NAME_CHARS + 1)) != salted("m")

    def templated(template: str) -> str:
        body = {"model": "m", "messages": [{"role": "user", "content": "x"}],
                "chat_template": template}  # fmt: skip
        return request_namespace(ChatCompletionRequest.model_validate(body), renders=True)

    assert templated("{{ a }}" * 1_000_000) == templated("x" * (MAX_TEMPLATE_CHARS + 1))
    assert templated("x" * MAX_TEMPLATE_CHARS) not in (templated("y"), DEFAULT)


def test_template_kwargs_past_their_bound_are_keyed_without_serializing_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`chat_template_kwargs` (where the router renders chats) were serialized whole,
    keys sorted, on the event loop: a 4 MB value cost tens of ms a request. Past
    MAX_KWARGS_CHARS of JSON, or MAX_KWARGS_DEPTH deep, a value is keyed as TOO_LONG,
    found by a walk that stops at the bound. The work is counted as the characters
    `json.dumps` and `repr` produce in the namespace module, not timed."""
    from router.holdings import namespace
    from router.holdings.namespace import MAX_KWARGS_CHARS, MAX_KWARGS_DEPTH

    made: list[int] = []  # the length of each serialization's output

    def dumps(value: object, **kw: object) -> str:
        out = json.dumps(value, **kw)  # type: ignore[arg-type]
        made.append(len(out))
        return out

    def counted_repr(value: object) -> str:
        out = repr(value)
        made.append(len(out))
        return out

    monkeypatch.setattr(namespace, "json", SimpleNamespace(dumps=dumps))
    monkeypatch.setattr(namespace, "repr", counted_repr, raising=False)

    def keyed(kwargs: object) -> str:
        body = {"model": "m", "messages": [{"role": "user", "content": "x"}],
                "chat_template_kwargs": kwargs}  # fmt: skip
        return request_namespace(ChatCompletionRequest.model_validate(body), renders=True)

    docs = [{"title": f"doc {i}", "text": "x" * 30} for i in range(70_000)]  # ~4 MB of JSON
    assert len(json.dumps(docs)) > 4_000_000
    deep: list = []
    inner = deep
    for _ in range(MAX_KWARGS_DEPTH + 1):
        inner.append([])
        inner = inner[0]
    made.clear()
    too_long = {keyed({"documents": docs}), keyed({"other": docs[1:]}), keyed({"d": deep}),
                keyed({"x": "x" * (MAX_KWARGS_CHARS + 1)})}  # fmt: skip
    listed = keyed(docs)  # not vLLM's shape (a list): keyed by a repr, within the bound
    assert sum(made) < 1024, made  # fails without the bound: 4 MB serialized
    assert len(too_long) == 1 and listed not in too_long | {DEFAULT}  # contents unread
    # Real values are keyed by their contents, up to the bound.
    at_bound = {keyed({"d": "x" * (MAX_KWARGS_CHARS - 100)}), keyed({"d": "y" * 100}),
                keyed({"enable_thinking": False}), keyed({"enable_thinking": True}),
                keyed({"d": docs[:1000]}), keyed([1, 2])}  # fmt: skip
    assert len(at_bound) == 6 and not at_bound & (too_long | {DEFAULT})
