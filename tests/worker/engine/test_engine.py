"""The sync engine on the tiny random-weight model: radix vs no cache, a pool too small
for the load, stop conditions and bad input. `check_integrity()` after every step."""

from __future__ import annotations

import random
from collections import defaultdict
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.engine.config import EngineConfig
from worker.engine.engine import LLMEngine
from worker.engine.req import Req
from worker.engine.runtime.load import load_engine
from worker.engine.types import EngineError, EngineRequest, GenerateOutput, SamplingParams

FIRST_PLAIN_ID = 4  # 0..3 are the tiny tokenizer's special tokens


def make_engine(model_dir: Path, **cfg: object) -> LLMEngine:
    cfg.setdefault("kv_capacity_tokens", 4096)
    cfg.setdefault("device", "cpu")
    return load_engine(model_dir, EngineConfig(**cfg))  # type: ignore[arg-type]


def run(engine: LLMEngine, *requests: EngineRequest) -> dict[str, list[GenerateOutput]]:
    for r in requests:
        engine.add_request(r)
    outs: dict[str, list[GenerateOutput]] = defaultdict(list)
    for _ in range(5000):
        if not engine.has_work:
            return outs
        for out in engine.step():
            outs[out.request_id].append(out)
        engine.check_integrity()
    raise AssertionError("engine did not finish")


def tokens(outs: list[GenerateOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def req(rid: str, ids: list[int], max_tokens: int = 8, **params: object) -> EngineRequest:
    params.setdefault("temperature", 0.0)
    params.setdefault("ignore_eos", True)
    sp = SamplingParams(max_tokens=max_tokens, **params)  # type: ignore[arg-type]
    return EngineRequest(rid, prompt_token_ids=tuple(ids), params=sp)


def rand_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(FIRST_PLAIN_ID, 1000) for _ in range(n)]


@pytest.mark.parametrize("page_size", [1, 16])
def test_radix_equals_no_cache_and_skips_the_shared_prefix(
    tiny_model_dir: Path, page_size: int
) -> None:
    rng = random.Random(0)
    prefix = rand_ids(rng, 100)
    a = [*prefix, *rand_ids(rng, 10)]
    b, c = [*prefix, 7, *rand_ids(rng, 12)], [*prefix, 8, *rand_ids(rng, 5)]
    assert a[100] not in (7, 8)
    # In order: overlap decodes once more per request (test_overlap.py), which this counts.
    radix = make_engine(tiny_model_dir, page_size=page_size, overlap_schedule=False)
    plain = make_engine(tiny_model_dir, disable_radix_cache=True)
    expect_prefix = 100 - 100 % page_size

    got_a = run(radix, req("a", a))["a"]
    before = radix.runner.tokens_computed
    got_bc = run(radix, req("b", b), req("c", c))
    # Only the uncached suffixes (and 7 decode steps each) went through the model.
    assert radix.runner.tokens_computed - before == (len(b) + len(c) - 2 * expect_prefix) + 2 * 7
    got_again = run(radix, req("a2", a))["a2"]

    want = run(plain, req("a", a), req("b", b), req("c", c), req("a2", a))
    assert tokens(got_a) == tokens(want["a"])
    assert tokens(got_bc["b"]) == tokens(want["b"])
    assert tokens(got_bc["c"]) == tokens(want["c"])
    assert tokens(got_again) == tokens(want["a2"])

    assert got_a[-1].cached_tokens == 0
    assert got_bc["b"][-1].cached_tokens == got_bc["c"][-1].cached_tokens == expect_prefix
    # A repeated prompt: all but its last token (which must run to give logits).
    assert got_again[-1].cached_tokens == (len(a) - 1) - (len(a) - 1) % page_size
    assert all(o[-1].cached_tokens == 0 for o in want.values())
    final = got_bc["b"][-1]
    assert (final.finished, final.finish_reason, final.prompt_tokens, final.completion_tokens) == (
        True,
        "length",
        len(b),
        8,
    )


def test_small_pool_evicts_and_preempts_with_identical_outputs(tiny_model_dir: Path) -> None:
    rng = random.Random(1)
    stems = [rand_ids(rng, 40), rand_ids(rng, 40)]
    requests = [
        req(f"r{i}", [*stems[i % 2], *rand_ids(rng, rng.randrange(5, 30))], max_tokens=16)
        for i in range(8)
    ]
    big = make_engine(tiny_model_dir)
    want = run(big, *requests)

    small = make_engine(
        tiny_model_dir, kv_capacity_tokens=160, max_prefill_tokens=64, evict_batch_tokens=32
    )
    evicted: list[int] = []
    evict = small.cache.evict
    small.cache.evict = lambda n: evicted.append(evict(n)) or evicted[-1]  # count, then evict
    got = run(small, *requests)

    assert small.scheduler.num_preemptions > 0
    assert sum(evicted) > 0
    for r in requests:
        assert tokens(got[r.request_id]) == tokens(want[r.request_id]), r.request_id
        assert got[r.request_id][-1].finish_reason == "length"
    assert small.flush_cache() is True
    small.check_integrity()
    assert small.allocator.available == small.allocator.capacity
    assert small.stats().kv_used_tokens == 0


def test_stop_token_ids_eos_and_ignore_eos(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    ids = rand_ids(random.Random(2), 20)
    free = tokens(run(engine, req("free", ids, max_tokens=12))["free"])
    stop_at = next(i for i in range(2, 12) if free[i] not in free[:i])
    target = free[stop_at]

    out = run(engine, req("s", ids, max_tokens=12, stop_token_ids=(target,)))["s"]
    assert tokens(out) == free[: stop_at + 1]  # the stop token is counted and returned...
    assert (out[-1].finish_reason, out[-1].completion_tokens) == ("stop", stop_at + 1)
    text_with = "".join(
        o.text_delta for o in run(engine, req("t", ids, max_tokens=stop_at + 1))["t"]
    )
    text_stop = "".join(o.text_delta for o in out)
    assert text_with.startswith(text_stop)  # ...but its text is not

    engine.eos_ids = frozenset({target})  # pretend the model's eos is that token
    eos = run(engine, req("e", ids, max_tokens=12, ignore_eos=False))["e"]
    assert tokens(eos) == free[: stop_at + 1] and eos[-1].finish_reason == "stop"
    ignored = run(engine, req("i", ids, max_tokens=12, ignore_eos=True))["i"]
    assert tokens(ignored) == free and ignored[-1].finish_reason == "length"


def test_stop_strings_cut_the_text_and_hold_back_partial_matches(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    prompt = "the teacher reads three books because it is fun."
    base = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    full = "".join(
        o.text_delta for o in run(engine, EngineRequest("f", prompt=prompt, params=base))["f"]
    )
    assert len(full) > 12, full
    stop = full[6:10]
    cut = full[: full.index(stop)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=("zzzzqq", stop))
    out = run(engine, EngineRequest("s", prompt=prompt, params=params))["s"]
    assert "".join(o.text_delta for o in out) == cut
    assert out[-1].finish_reason == "stop"
    # Nothing streamed ever reached into the stop string.
    streamed = ""
    for o in out:
        streamed += o.text_delta
        assert cut.startswith(streamed)


BAD_REQUESTS = [
    ("prompt", EngineRequest("x", prompt="")),
    ("prompt", EngineRequest("x", prompt_token_ids=())),
    ("prompt", EngineRequest("x")),
    ("prompt", EngineRequest("x", prompt="hi", prompt_token_ids=(5,))),
    ("prompt", EngineRequest("x", prompt_token_ids=(5, 1024))),
    ("prompt", EngineRequest("x", prompt_token_ids=(5, -1))),
    ("prompt", EngineRequest("x", prompt_token_ids=(5,) * 2048)),
    (
        "max_tokens",
        EngineRequest("x", prompt_token_ids=(5,) * 2000, params=SamplingParams(max_tokens=49)),
    ),
    ("max_tokens", EngineRequest("x", prompt="hi", params=SamplingParams(max_tokens=0))),
    ("temperature", EngineRequest("x", prompt="hi", params=SamplingParams(temperature=-0.5))),
    ("top_p", EngineRequest("x", prompt="hi", params=SamplingParams(top_p=0.0))),
    ("top_p", EngineRequest("x", prompt="hi", params=SamplingParams(top_p=1.5))),
    ("top_k", EngineRequest("x", prompt="hi", params=SamplingParams(top_k=0))),
    ("stop", EngineRequest("x", prompt="hi", params=SamplingParams(stop=("",)))),
    (
        "stop_token_ids",
        EngineRequest("x", prompt="hi", params=SamplingParams(stop_token_ids=(99999,))),
    ),
]


def test_bad_input_is_refused_and_harms_no_other_request(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    good = req("good", rand_ids(random.Random(3), 30), max_tokens=10)
    engine.add_request(good)
    outs = []
    for _ in range(3):
        outs += engine.step()
        engine.check_integrity()
    for param, bad in BAD_REQUESTS:
        with pytest.raises(EngineError) as err:
            engine.add_request(bad)
        assert err.value.param == param, bad
        engine.check_integrity()
    with pytest.raises(EngineError) as err:
        engine.add_request(req("good", [5, 6, 7]))  # its id is in flight
    assert err.value.param == "request_id"
    outs += run(engine)["good"]
    assert outs[-1].finish_reason == "length" and outs[-1].completion_tokens == 10
    assert engine.stats().waiting == engine.stats().running == 0


def test_abort_and_stats(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    rng = random.Random(4)
    engine.add_request(req("long", rand_ids(rng, 50), max_tokens=100))
    engine.add_request(req("queued", rand_ids(rng, 50), max_tokens=5))
    for _ in range(3):
        engine.step()
        engine.check_integrity()
    [final] = engine.abort("long")
    assert final.finished and final.finish_reason == "abort"
    assert engine.abort("long") == []  # already gone
    engine.check_integrity()
    run(engine)
    stats = engine.stats()
    assert (stats.running, stats.waiting, stats.prompt_tokens_total) == (0, 0, 100)
    assert stats.completion_tokens_total == final.completion_tokens + 5
    engine.flush_cache()
    assert engine.allocator.available == engine.allocator.capacity


class _Chunks:
    """A detokenizer that yields given text pieces, one per token."""

    def __init__(self, chunks: list[str]) -> None:
        self._chunks = iter(chunks)

    def push(self, token_id: int) -> str:
        return next(self._chunks)


@settings(max_examples=300, deadline=None)
@given(
    chunks=st.lists(st.text(alphabet="ab c", max_size=4), min_size=1, max_size=12),
    stops=st.lists(st.text(alphabet="ab c", min_size=1, max_size=3), min_size=1, max_size=3),
)
def test_stop_strings_stream_a_prefix_and_cut_at_the_first_match(
    chunks: list[str], stops: list[str]
) -> None:
    params = SamplingParams(max_tokens=len(chunks), stop=tuple(stops))
    seq = Req("r", [1], params, _Chunks(chunks), seq_id=0)
    full, streamed = "".join(chunks), ""
    while seq.finish_reason is None:
        seq.append_token(5, max_model_len=10**9)
        streamed += seq.take_text_delta()
    assert full.startswith(streamed)
    assert not any(s in streamed for s in stops)  # never streams a stop string
    if seq.finish_reason == "stop":
        assert any(full.startswith(streamed + s) for s in stops)
    else:
        assert streamed == full and not any(s in full for s in stops)


@settings(max_examples=200, deadline=None)
@given(
    chunks=st.lists(st.text(alphabet="ab", max_size=5), min_size=1, max_size=20),
    stops=st.lists(st.text(alphabet="ab", min_size=1, max_size=12), min_size=1, max_size=4),
)
def test_stop_matching_agrees_with_a_rescan_on_self_overlapping_stops(
    chunks: list[str], stops: list[str]
) -> None:
    """The KMP matcher against the definition, a rescan after every token: the request
    stops at the first token after which a stop string occurs, cut where the earliest
    one occurring then starts."""
    params = SamplingParams(max_tokens=len(chunks), stop=tuple(stops))
    seq = Req("r", [1], params, _Chunks(chunks), seq_id=0)
    while seq.finish_reason is None:
        seq.append_token(5, max_model_len=10**9)
    text, want = "", None
    for chunk in chunks:
        text += chunk
        hits = [i for i in (text.find(s) for s in stops) if i != -1]
        if hits:
            want = text[: min(hits)]
            break
    if want is not None:
        assert seq.finish_reason == "stop" and seq.text == want
    else:
        assert seq.finish_reason == "length" and seq.text == text
