"""The `sim` backend: the engine itself (scheduler, radix cache, allocator, continuous
batching) with a cost model where the model would be. No torch is imported on this
path, so fleet benchmarks and load tests run it on any CPU, and everything that shapes
routing is the engine's own code: admission with output reservation, chunked prefill,
in-flight prefix sharing, LRU eviction, preemption.

Only the model is fake:

- cost (`CostModelRunner`): a step costs

      decode_ms_per_token                      one pass over the weights, every step
    + decode_us_per_seq x decoders in it       per-row work (sampling, activations)
    + decode_us_per_1k_context x context / 1k  the KV every decoder reads (all its
                                               tokens so far, each step)
    + prefill_us_per_token x prefill tokens    the prefill chunks it runs

  At batch 64 x 2k context the KV read is ~63% of a Llama-3.2-1B step's bytes: a
  constant step price under-priced every long-context fleet study. The form is fitted
  to the engine's own CPU steps by `python -m loadtests sim-calibrate`
  (loadtests/results/sim_cost.md). The live worker sleeps it in the engine thread;
  the virtual-time simulator (`loadtests/simulate/worker.py`) adds it to its clock instead.
- output (`SimSampler`): the prompt's deterministic answer (`sim_model.answer_ids`,
  same prompt, same answer), one token per step, cut short only by a stop string or a
  stop token id. It never emits EOS; penalties and biases do not change it; logprobs
  are 0.0 (the answer is certain), with the chosen token as its only alternative.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from worker.backends.sim_model import answer_ids
from worker.engine.batch import BatchItem
from worker.engine.config import EngineConfig
from worker.engine.engine import LLMEngine
from worker.engine.free_memory import SIM_BYTES_PER_SLOT, check_slots_fit
from worker.engine.protocols import EngineTokenizer
from worker.engine.types import TokenLogprob

if TYPE_CHECKING:
    from worker.engine.req import Req
    from worker.engine.types import KVCopies


# The host tier's defaults: an 8B-class model's KV (Llama-3-8B: 32 layers x 8 KV heads x
# 128 x 2 (K, V) x 2 bytes = 128 KiB a token) over PCIe 5 x16 at a practical 25 GB/s
# (load ~5.2 us a token, against a prefill cost of tens of us a token on the same GPU).
DEFAULT_KV_BYTES_PER_TOKEN = 131_072
DEFAULT_HOST_LOAD_BYTES_PER_S = 25e9


@dataclass(frozen=True)
class SimModelConfig:
    """The few model facts the engine reads from a runner."""

    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...] = ()


class CostModelRunner:
    """Stands where `ModelRunner` stands: takes the batch, charges its cost, keeps no KV."""

    def __init__(
        self,
        capacity: int,
        model: SimModelConfig,
        prefill_us_per_token: float = 0.0,
        decode_ms_per_token: float = 0.0,
        sleep: Callable[[float], None] | None = time.sleep,
        decode_us_per_seq: float = 0.0,
        decode_us_per_1k_context: float = 0.0,
        host_capacity: int = 0,
        host_load_bytes_per_s: float = DEFAULT_HOST_LOAD_BYTES_PER_S,
        kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN,
    ) -> None:
        self.capacity = capacity
        # The host tier (0: off): a load costs its bytes over the bandwidth, added to the
        # next forward (the forward waits for the loads, as the CUDA runner's does).
        # Write-backs run the other way over a full-duplex link: not charged.
        self.host_capacity = host_capacity
        self.host_load_bytes_per_s = host_load_bytes_per_s
        self.kv_bytes_per_token = kv_bytes_per_token
        self._load_s = 0.0
        self.config = model
        self.prefill_us_per_token = prefill_us_per_token  # reported in the engine's stats
        self.decode_ms_per_token = decode_ms_per_token
        self.prefill_s = prefill_us_per_token / 1e6
        self.step_s = decode_ms_per_token / 1e3
        self.seq_s = decode_us_per_seq / 1e6
        self.context_s = decode_us_per_1k_context / 1e9  # per context token
        self.sleep = sleep  # None: virtual time, the caller reads `last_step_s`
        self.tokens_computed = 0
        self.last_step_s = 0.0

    def forward(self, batch: list[BatchItem]) -> None:
        self.last_step_s = self.step_cost(batch) + self._load_s
        self._load_s = 0.0
        if self.sleep is not None and self.last_step_s > 0:
            self.sleep(self.last_step_s)

    def step_cost(self, batch: list[BatchItem]) -> float:
        """Seconds the step takes (the module docstring's formula); counts its tokens."""
        prefill = context = decoders = 0
        for item in batch:
            n = len(item.input_ids)
            self.tokens_computed += n
            if n > 1:
                prefill += n  # its price per token covers its attention too
            else:
                decoders += 1
                context += item.start_pos + 1  # a decoder reads all its KV
        return (
            self.step_s + self.seq_s * decoders + self.context_s * context
            + self.prefill_s * prefill
        )  # fmt: skip

    def copy_kv(self, copies: KVCopies) -> None:
        nbytes = copies.load_tokens * self.kv_bytes_per_token
        self._load_s += nbytes / self.host_load_bytes_per_s

    def release(self, seq_id: int) -> None:
        pass  # no per-sequence state


class SimSampler:
    """The next token of each request's deterministic answer."""

    def __init__(self, tokenizer: EngineTokenizer) -> None:
        self.tokenizer = tokenizer
        self._answers: dict[int, list[int]] = {}  # seq_id -> its whole answer

    def sample(self, logits: None, reqs: list[Req]) -> list[tuple[int, TokenLogprob | None]]:
        out: list[tuple[int, TokenLogprob | None]] = []
        for req in reqs:
            answer = self._answers.get(req.seq_id)
            if answer is None:
                answer = answer_ids(self.tokenizer, req.prompt_ids, req.params.max_tokens)
                self._answers[req.seq_id] = answer
            token = answer[len(req.output_ids)]
            lp = TokenLogprob(token, 0.0, ((token, 0.0),)) if req.params.needs_logprobs else None
            out.append((token, lp))
        return out

    def release(self, seq_id: int) -> None:
        self._answers.pop(seq_id, None)


def build_sim_llm_engine(
    config: EngineConfig,
    tokenizer: EngineTokenizer,
    *,
    max_model_len: int = 32_768,
    prefill_us_per_token: float = 0.0,
    decode_ms_per_token: float = 0.0,
    sleep: Callable[[float], None] | None = time.sleep,
    decode_us_per_seq: float = 0.0,
    decode_us_per_1k_context: float = 0.0,
    host_load_bytes_per_s: float = DEFAULT_HOST_LOAD_BYTES_PER_S,
    kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN,
) -> LLMEngine:
    """The engine over a cost model; `config.kv_capacity_tokens` sizes its KV and
    `config.host_cache_tokens` its host tier."""
    model = SimModelConfig(tokenizer.vocab_size, max_model_len)
    capacity = config.kv_capacity_tokens or 1_000_000
    # The same refusal as the radix engine's host tier, for what the sim does allocate:
    # its slot bookkeeping (worker/engine/free_memory.py).
    check_slots_fit("kv_capacity_tokens", capacity, SIM_BYTES_PER_SLOT)
    if config.host_cache_tokens:
        check_slots_fit("host_cache_tokens", config.host_cache_tokens, SIM_BYTES_PER_SLOT)
    runner = CostModelRunner(
        capacity, model, prefill_us_per_token, decode_ms_per_token, sleep,
        decode_us_per_seq, decode_us_per_1k_context,
        host_capacity=config.host_cache_tokens,
        host_load_bytes_per_s=host_load_bytes_per_s,
        kv_bytes_per_token=kv_bytes_per_token,
    )  # fmt: skip
    return LLMEngine(runner, tokenizer, config, SimSampler(tokenizer))
