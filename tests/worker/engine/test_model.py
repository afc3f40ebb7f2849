"""Our decoder against transformers on the same random tiny weights (fp32, CPU).

Every comparison is at the logits of the same positions: transformers runs the whole
sequence at once, we run it as a prefill, in chunks over a cached prefix, one token
at a time, or batched with other sequences; with the sdpa backend and with the triton
kernels (under TRITON_INTERPRET=1 on CPU, set by tests/conftest.py).
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests.worker.engine.slots import allocator_for
from worker.engine.model_config import ModelConfig
from worker.engine.runtime.runner import BatchItem, ModelRunner
from worker.models.tiny_model import make_tiny_model

transformers = pytest.importorskip("transformers")

ATOL = 1e-4


@functools.lru_cache(maxsize=4)
def hf_model(model_dir: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_logits(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """transformers' fp32 logits at every position of `ids`: [len(ids), vocab]."""
    model = hf_model(model_dir)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def runner_for(
    model_dir: Path, capacity: int = 1024, dtype: str = "float32", backend: str = "sdpa"
) -> ModelRunner:
    return ModelRunner(
        model_dir,
        device="cpu",
        dtype=dtype,
        kv_capacity_tokens=capacity,
        attention_backend=backend,
    )


NO_TRITON = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
BACKENDS = pytest.mark.parametrize("backend", ["sdpa", pytest.param("triton", marks=NO_TRITON)])


def run_in_chunks(runner: ModelRunner, ids: list[int], cuts: list[int]) -> dict[int, torch.Tensor]:
    """Run `ids` split at `cuts`, each chunk over the KV of the previous ones; returns the
    logits of each chunk's last position, keyed by position."""
    slots = allocator_for(runner).alloc(len(ids))
    assert slots is not None
    out: dict[int, torch.Tensor] = {}
    bounds = [0, *cuts, len(ids)]
    for start, end in itertools.pairwise(bounds):
        logits = runner.forward([BatchItem(ids[start:end], start, slots[:end])])
        out[end - 1] = logits[0]
    return out


def sample_ids(n: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, vocab) for _ in range(n)]


@pytest.fixture(params=["llama", "qwen2"])
def model_dir(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(
        "tiny_model_dir" if request.param == "llama" else "tiny_qwen2_dir"
    )


def test_full_prefill_matches_transformers(model_dir: Path) -> None:
    runner = runner_for(model_dir)
    ids = sample_ids(48, runner.config.vocab_size, seed=1)
    ref = hf_logits(model_dir, ids)
    got = run_in_chunks(runner, ids, cuts=[])
    assert got[47].shape == (runner.config.vocab_size,)
    assert got[47].dtype == torch.float32
    torch.testing.assert_close(got[47], ref[47], atol=ATOL, rtol=0)
    # Not trivially equal: the model's logits spread over several units.
    assert ref[47].std() > 0.5


@BACKENDS
def test_chunked_prefill_then_decode_matches_transformers(model_dir: Path, backend: str) -> None:
    runner = runner_for(model_dir, backend=backend)
    ids = sample_ids(40, runner.config.vocab_size, seed=2)
    ref = hf_logits(model_dir, ids)
    # A 13-token prefix, chunks of 5 and 9, then one token at a time.
    cuts = [13, 18, 27, *range(28, 40)]
    got = run_in_chunks(runner, ids, cuts)
    assert sorted(got) == [12, 17, 26, *range(27, 40)]
    for pos, logits in got.items():
        torch.testing.assert_close(logits, ref[pos], atol=ATOL, rtol=0, msg=f"position {pos}")


@BACKENDS
def test_batch_of_sequences_with_shared_prefix_slots(tiny_model_dir: Path, backend: str) -> None:
    """Three sequences in one forward: a fresh prefill, a suffix over a prefix another
    sequence already wrote (shared slots, as the radix cache hands out), and a decode."""
    runner = runner_for(tiny_model_dir, backend=backend)
    vocab = runner.config.vocab_size
    alloc = allocator_for(runner)
    prefix = sample_ids(20, vocab, seed=3)
    a = [*prefix, *sample_ids(6, vocab, seed=4)]
    b = [*prefix, *sample_ids(11, vocab, seed=5)]
    c = sample_ids(30, vocab, seed=6)
    a_slots = alloc.alloc(len(a))
    c_slots = alloc.alloc(len(c))
    # Step 1: A prefilled alone; C prefilled up to its last token.
    runner.forward([BatchItem(a, 0, a_slots), BatchItem(c[:-1], 0, c_slots[:-1])])
    # Step 2: B reuses A's 20 prefix slots; C decodes; D is a fresh prefill.
    b_slots = np.concatenate([a_slots[:20], alloc.alloc(len(b) - 20)])
    d = sample_ids(9, vocab, seed=7)
    d_slots = alloc.alloc(len(d))
    before = runner.tokens_computed
    logits = runner.forward(
        [
            BatchItem(b[20:], 20, b_slots),
            BatchItem(c[-1:], len(c) - 1, c_slots),
            BatchItem(d, 0, d_slots),
        ]
    )
    assert runner.tokens_computed - before == (len(b) - 20) + 1 + len(d)
    for row, req in enumerate((b, c, d)):
        torch.testing.assert_close(
            logits[row], hf_logits(tiny_model_dir, req)[-1], atol=ATOL, rtol=0
        )


@BACKENDS
def test_many_decodes_in_one_step_match_transformers(model_dir: Path, backend: str) -> None:
    """Several one-token decodes with different context lengths interleaved with a
    prefill chunk, in one forward (a mixed step: both triton kernels run)."""
    runner = runner_for(model_dir, backend=backend)
    vocab, alloc = runner.config.vocab_size, allocator_for(runner)
    reqs = [sample_ids(n, vocab, seed=20 + n) for n in (5, 31, 2, 17)]
    slots = [alloc.alloc(len(s)) for s in reqs]
    runner.forward([BatchItem(s[:-1], 0, sl[:-1]) for s, sl in zip(reqs, slots, strict=True)])
    chunked = sample_ids(12, vocab, seed=30)
    chunk_slots = alloc.alloc(12)
    runner.forward([BatchItem(chunked[:4], 0, chunk_slots[:4])])
    items = [BatchItem(s[-1:], len(s) - 1, sl) for s, sl in zip(reqs, slots, strict=True)]
    items.insert(2, BatchItem(chunked[4:], 4, chunk_slots))
    logits = runner.forward(items)
    expected = [*reqs[:2], chunked, *reqs[2:]]
    for row, req in enumerate(expected):
        want = hf_logits(model_dir, req)[-1]
        torch.testing.assert_close(logits[row], want, atol=ATOL, rtol=0, msg=f"row {row}")


def test_random_chunkings_agree(tiny_qwen2_dir: Path) -> None:
    """Any split of a sequence into chunks gives the same last logits."""
    runner = runner_for(tiny_qwen2_dir, capacity=2048)
    ids = sample_ids(33, runner.config.vocab_size, seed=8)
    ref = hf_logits(tiny_qwen2_dir, ids)[-1]
    rng = random.Random(9)
    for _ in range(5):
        cuts = sorted(rng.sample(range(1, len(ids)), k=rng.randint(1, 6)))
        got = run_in_chunks(runner, ids, cuts)[len(ids) - 1]
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=0, msg=f"cuts {cuts}")


@pytest.mark.parametrize(
    "rope_scaling",
    [
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        {"rope_type": "linear", "factor": 4.0},
    ],
    ids=["llama3", "linear"],
)
def test_rope_scaling_matches_transformers(tmp_path: Path, rope_scaling: dict) -> None:
    model_dir = make_tiny_model(tmp_path, rope_theta=500000.0, rope_scaling=rope_scaling)
    config = ModelConfig.from_dir(model_dir)
    assert config.rope_scaling is not None
    assert config.rope_scaling.rope_type == rope_scaling["rope_type"]
    runner = runner_for(model_dir)
    # Past original_max_position_embeddings, where llama3 scaling changes frequencies.
    ids = sample_ids(100, runner.config.vocab_size, seed=10)
    ref = hf_logits(model_dir, ids)
    got = run_in_chunks(runner, ids, cuts=[70, 99])
    for pos in (69, 98, 99):
        torch.testing.assert_close(got[pos], ref[pos], atol=ATOL, rtol=0)
    # And the scaling matters: an unscaled model gives different logits.
    plain = make_tiny_model(tmp_path / "plain", rope_theta=500000.0)
    unscaled = run_in_chunks(runner_for(plain), ids, cuts=[])[99]
    assert (unscaled - ref[99]).abs().max() > 1e-3


@pytest.mark.parametrize(
    ("window", "backend"),
    [(None, "sdpa"), (7, "sdpa"), pytest.param(7, "triton", marks=NO_TRITON)],
)
def test_mistral_matches_transformers(
    tmp_path: Path, tiny_model_dir: Path, window: int | None, backend: str
) -> None:
    """Mistral, with no window and with a sliding window of 7 tokens (shorter than the
    prompt, the chunks and the prefix, so every attention path is cut by it)."""
    model_dir = tmp_path / "mistral"
    shutil.copytree(tiny_model_dir, model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    for key in ("attention_bias", "mlp_bias"):
        cfg.pop(key)
    cfg |= {
        "model_type": "mistral",
        "architectures": ["MistralForCausalLM"],
        "sliding_window": window,
    }
    (model_dir / "config.json").write_text(json.dumps(cfg))
    runner = runner_for(model_dir, backend=backend)
    assert runner.config.sliding_window == window
    ids = sample_ids(25, runner.config.vocab_size, seed=11)
    ref = hf_logits(model_dir, ids)
    got = run_in_chunks(runner, ids, cuts=[12, 20, 21])
    for pos in (11, 19, 20, 24):
        torch.testing.assert_close(got[pos], ref[pos], atol=ATOL, rtol=0, msg=f"position {pos}")
    if window:  # the window matters: full attention differs
        full = runner_for(tiny_model_dir)
        assert (run_in_chunks(full, ids, cuts=[])[24] - ref[24]).abs().max() > 1e-3


@BACKENDS
def test_qwen3_matches_transformers(tiny_qwen3_dir: Path, backend: str) -> None:
    runner = runner_for(tiny_qwen3_dir, backend=backend)
    assert runner.config.qk_norm and runner.config.model_type == "qwen3"
    ids = sample_ids(30, runner.config.vocab_size, seed=14)
    ref = hf_logits(tiny_qwen3_dir, ids)
    got = run_in_chunks(runner, ids, cuts=[17, 29])
    for pos in (16, 28, 29):
        torch.testing.assert_close(got[pos], ref[pos], atol=ATOL, rtol=0, msg=f"position {pos}")


def test_sharded_checkpoint_loads_identically(tmp_path: Path, tiny_model_dir: Path) -> None:
    sharded = make_tiny_model(tmp_path, num_shards=3)
    assert len(list(sharded.glob("*.safetensors"))) == 3
    assert (sharded / "model.safetensors.index.json").is_file()
    a, b = runner_for(tiny_model_dir), runner_for(sharded)
    for (name, p), (name_b, p_b) in zip(
        a.model.state_dict().items(), b.model.state_dict().items(), strict=True
    ):
        assert name == name_b
        assert torch.equal(p, p_b), name
    ids = sample_ids(12, a.config.vocab_size, seed=12)
    torch.testing.assert_close(
        run_in_chunks(b, ids, [])[11], hf_logits(tiny_model_dir, ids)[11], atol=ATOL, rtol=0
    )


def test_missing_shard_and_mismatched_config_are_clear_errors(tmp_path: Path) -> None:
    sharded = make_tiny_model(tmp_path / "s", num_shards=2)
    next(sharded.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(FileNotFoundError, match="missing shards"):
        runner_for(sharded)
    wrong = make_tiny_model(tmp_path / "w")
    cfg = json.loads((wrong / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps(cfg | {"num_hidden_layers": 3}))
    with pytest.raises(ValueError, match="missing"):
        runner_for(wrong)
    (wrong / "config.json").write_text(json.dumps(cfg | {"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unsupported model_type"):
        runner_for(wrong)


def test_bf16_runs_close_to_fp32(tiny_model_dir: Path) -> None:
    runner = runner_for(tiny_model_dir, dtype="bfloat16")
    assert runner.pool.k[0].dtype == torch.bfloat16
    ids = sample_ids(16, runner.config.vocab_size, seed=13)
    got = run_in_chunks(runner, ids, cuts=[10])
    assert got[15].dtype == torch.float32
    ref = hf_logits(tiny_model_dir, ids)[15]
    # bf16 has 8 mantissa bits: close, not equal.
    assert (got[15] - ref).abs().max() < 0.1 * ref.abs().max()


def test_config_parsing_spellings() -> None:
    base = {
        "model_type": "mistral",
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "head_dim": None,  # Mistral configs say null: derived as hidden / heads
        "eos_token_id": 2,
    }
    cfg = ModelConfig.from_dict(base, {"eos_token_id": [7, 2]})
    assert cfg.head_dim == 16 and cfg.num_key_value_heads == 4
    assert cfg.eos_token_ids == (2, 7)
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.tie_word_embeddings) == (10000.0, None, False)
    # transformers 5 writes RoPE settings under rope_parameters.
    v5 = base | {
        "rope_parameters": {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0},
        "dtype": "bfloat16",
    }
    cfg5 = ModelConfig.from_dict(v5)
    assert cfg5.rope_theta == 1e6 and cfg5.torch_dtype == "bfloat16"
    assert cfg5.rope_scaling is not None and cfg5.rope_scaling.factor == 2.0
    # Mistral's sliding window is attended as such: the context is not cut to it.
    windowed = base | {"sliding_window": 4096, "max_position_embeddings": 32768}
    cfg_sw = ModelConfig.from_dict(windowed)
    assert (cfg_sw.max_model_len, cfg_sw.sliding_window) == (32768, 4096)
    qwen_sw = windowed | {"model_type": "qwen2", "use_sliding_window": False}
    assert ModelConfig.from_dict(qwen_sw).sliding_window is None
    # Qwen's per-layer windows are refused at load time, not run wrong.
    with pytest.raises(ValueError, match="use_sliding_window"):
        ModelConfig.from_dict(qwen_sw | {"use_sliding_window": True})
    qwen = ModelConfig.from_dict(base | {"model_type": "qwen2"})
    assert qwen.qkv_bias and not qwen.o_bias
    qwen3 = ModelConfig.from_dict(base | {"model_type": "qwen3", "head_dim": 32})
    assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.head_dim == 32
    for bad, message in [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope_scaling"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_key_value_heads": 3}, "not a multiple"),
    ]:
        with pytest.raises(ValueError, match=message):
            ModelConfig.from_dict(base | bad)
