"""The whole engine on the tiny model with each attention backend: the same greedy
tokens from `--attention-backend triton` (triton's interpreter on CPU here) as from
the sdpa reference, over shared prefixes, chunked prefills and batched decodes."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from shared.config import WorkerConfig, load_config
from worker.backends import engine_config
from worker.engine.config import EngineConfig
from worker.engine.engine import LLMEngine
from worker.engine.runtime.load import load_engine
from worker.engine.types import EngineRequest, SamplingParams


def greedy_run(model_dir: Path, backend: str) -> tuple[dict[str, list[int]], LLMEngine]:
    config = EngineConfig(
        device="cpu", kv_capacity_tokens=2048, attention_backend=backend,
        max_prefill_tokens=24,  # prompts of 40+ tokens prefill in chunks next to decodes
    )  # fmt: skip
    engine = load_engine(model_dir, config)
    rng = random.Random(5)
    shared = [rng.randrange(4, 1000) for _ in range(30)]
    prompts = {
        "a": shared + [rng.randrange(4, 1000) for _ in range(12)],
        "b": shared + [rng.randrange(4, 1000) for _ in range(5)],
        "c": [rng.randrange(4, 1000) for _ in range(9)],
    }
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    for i, (rid, ids) in enumerate(prompts.items()):
        engine.add_request(EngineRequest(rid, prompt_token_ids=tuple(ids), params=params))
        for _ in range(i + 1):  # staggered arrivals: later ones join a running batch
            for o in engine.step():
                out[o.request_id].extend(o.token_ids)
            engine.check_integrity()
    drain(engine, out)
    # After they finished, their KV is in the radix tree: "d" prefills only its suffix.
    out["d"] = []
    d = shared + [rng.randrange(4, 1000) for _ in range(3)]
    engine.add_request(EngineRequest("d", prompt_token_ids=tuple(d), params=params))
    drain(engine, out)
    return out, engine


def drain(engine: LLMEngine, out: dict[str, list[int]]) -> None:
    while engine.has_work:
        for o in engine.step():
            out[o.request_id].extend(o.token_ids)
        engine.check_integrity()


def test_triton_backend_gives_the_same_greedy_tokens_as_sdpa(tiny_model_dir: Path) -> None:
    pytest.importorskip("triton")
    want, ref = greedy_run(tiny_model_dir, "sdpa")
    got, eng = greedy_run(tiny_model_dir, "triton")
    assert ref.runner.backend.name == "sdpa" and eng.runner.backend.name == "triton"
    assert all(len(t) == 10 for t in want.values())
    assert got == want
    assert eng.stats().cached_tokens_total >= 30  # "d" hit the shared prefix


def test_worker_config_reaches_the_engine() -> None:
    config = load_config(WorkerConfig, None, {"attention_backend": "triton",
                                              "disable_cuda_graph": True})  # fmt: skip
    engine_cfg = engine_config(config)
    assert engine_cfg.attention_backend == "triton" and engine_cfg.disable_cuda_graph
