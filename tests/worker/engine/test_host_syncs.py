"""One host synchronisation per engine step (issue 12, item 5), counted on CPU.

On CPU nothing waits, so `SyncCounter` counts the calls that would make the host wait
for a GPU: device->host reads of a tensor, host->device copies that are not
asynchronous, explicit synchronizes (loadtests/gpu/correct.py). Each step that samples
must make exactly one (the sampled ids and logprobs, packed); a step that samples
nothing (a prompt's chunk that is not its last) none. Decode-only, mixed, and with
penalties, logit_bias, seeds and logprobs; with the sdpa backend and with triton's
(whose kernel launches are device work: not counted, the interpreter runs them on
the host). The GPU check counts the same on CUDA with CUDA's sync debug mode.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from loadtests.gpu.correct import SyncCounter, syncs_per_step
from worker.engine.config import EngineConfig
from worker.engine.engine import LLMEngine
from worker.engine.runtime.load import load_engine
from worker.engine.runtime.sampler import TorchSampler
from worker.engine.types import SamplingParams


def engine_for(model_dir: Path, backend: str) -> LLMEngine:
    config = EngineConfig(device="cpu", kv_capacity_tokens=2048, attention_backend=backend,
                          max_prefill_tokens=16)  # fmt: skip
    return load_engine(model_dir, config)


@pytest.mark.parametrize("backend", ["sdpa", "triton"])
def test_one_sync_per_sampling_step(
    tiny_model_dir: Path, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if backend == "triton":
        pytest.importorskip("triton")
    engine = engine_for(tiny_model_dir, backend)
    counter = SyncCounter("cpu")
    if backend == "triton":
        from worker.engine.runtime.attention import triton_backend

        for name in ("decode_attention", "extend_attention"):
            launch = getattr(triton_backend, name)
            monkeypatch.setattr(triton_backend, name, paused(counter, launch))
    with counter:
        result = syncs_per_step(engine, counter)
    want = {"decode": [1], "mixed": [1], "penalties_logprobs": [1]}
    assert result["per_step"] == want, result["unexpected"]
    assert result["mixed_steps"] > 0 and result["passed"]
    assert min(result["steps"].values()) >= 4


def paused(counter: SyncCounter, launch: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        with counter.paused():
            return launch(*args, **kwargs)

    return run


def test_the_counter_sees_each_kind_of_sync() -> None:
    """It can fail: a read, a blocking copy up, a truth test of a tensor all count;
    device-side work and an asynchronous copy do not."""
    x = torch.arange(6.0)
    with SyncCounter("cpu") as counter:
        y = (x * 2).softmax(0)
        y.to(torch.float64)
        y.to("cpu", non_blocking=True)
        assert counter.count == 0
        y.max().item()
        assert counter.count == 1
        y.tolist()
        bool(y.sum() > 0)
        torch.tensor([1, 2], device="cpu")
        y.to("cpu")
        assert counter.count == 5, counter.events
    assert torch.Tensor.item.__name__ == "item"  # unpatched again


def test_sampler_reads_the_device_once_whatever_the_parameters() -> None:
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(1))
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=5, seed=3),
        SamplingParams(temperature=1.0, top_p=0.8, min_p=0.1, logprobs=True, top_logprobs=4),
        SamplingParams(
            temperature=0.0,
            repetition_penalty=1.5,
            presence_penalty=0.5,
            logit_bias=((7, 5.0),),
            logprobs=True,
        ),
        SamplingParams(temperature=1.3, frequency_penalty=1.0),
    ]
    sampler = TorchSampler(seed=0)
    reqs = [FakeReq(p, i) for i, p in enumerate(params)]
    with SyncCounter("cpu") as counter:
        out = sampler.sample(logits, reqs)  # type: ignore[arg-type]
    assert counter.count == 1, counter.events
    assert len(out) == 5 and out[0][1] is None and out[1][1] is None
    lp = out[2][1]
    assert lp is not None and len(lp.top) == 4
    want = logits[2].log_softmax(0)
    assert abs(lp.logprob - want[out[2][0]].item()) < 1e-5
    assert [t for t, _ in lp.top] == want.topk(4).indices.tolist()
    assert out[3][1] is not None and out[3][1].top == ()


class FakeReq:
    def __init__(self, params: SamplingParams, i: int) -> None:
        self.params = params
        self.seq_id = i
        self.index = 0
        self.output_ids = [7, 7, 2]
        self.prompt_ids = [1, 2, 3]
