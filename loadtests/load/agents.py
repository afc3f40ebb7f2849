"""The `agent` workload: sessions of tool-calling calls, as plain data any driver replays.

A session is what an agent framework sends for one task:

- `calls` calls in a chain. Call 1 is the system prompt (tool definitions, task) and a
  user turn; each later call is the whole context so far plus the last answer and the
  output of the tool it asked for (`tool_min`..`tool_max` words, uniform: 0.5-8k tokens).
- Between calls, the tool runs: a gap drawn from a log-normal distribution, median
  `gap_median_s`, shape `gap_sigma`, clipped to [`gap_min_s`, `gap_max_s`] (seconds to
  minutes, as coding agents' shell and test runs), divided by `speedup` for simulation.
- With probability `fanout_p` a call fans out `fanout_min`..`fanout_max` parallel
  siblings (sub-agents on one context, each with its own short instruction); the chain
  goes on from the first sibling's answer once all are answered.
- Every call carries `prompt_cache_key` = the session's id (what the OpenAI Agents SDK
  and Codex send: one key per conversation) and, when `pin_ttl_s` > 0, `cache_pin_ttl`
  (our extension, worker/engine/pins.py) for the gap that follows.

`agent_sessions(options)` gives the sessions with their start times (Poisson,
`session_rate` a second); a driver asks each for `next_step()` (the texts of the next
call or its siblings), sends them, and reports the answers with `on_answers`. The
simulator (loadtests/simulate/agents.py) and the live runner (loadtests/load/agent_live.py)
replay the same sessions.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from loadtests.load.workloads import words


@dataclass(frozen=True)
class AgentOptions:
    sessions: int = 32
    calls: int = 6  # calls per session (k), fan-outs counting as one
    session_rate: float = 0.5  # sessions started a second (Poisson)
    system_words: int = 1500  # tool definitions + task: one token a word in the simulator
    user_words: int = 60
    tool_min: int = 500  # tool output appended each call, words (~tokens)
    tool_max: int = 8000
    output_tokens: int = 48  # each answer
    gap_median_s: float = 20.0
    gap_sigma: float = 1.0
    gap_min_s: float = 2.0
    gap_max_s: float = 240.0
    speedup: float = 1.0  # tool gaps divided by this (simulation, short live runs)
    fanout_p: float = 0.25
    fanout_min: int = 2
    fanout_max: int = 8
    pin_ttl_s: float = 0.0  # cache_pin_ttl sent with each call (0: none)
    keys: bool = True  # send prompt_cache_key
    seed: int = 0


@dataclass
class AgentSession:
    """One agent task; see the module docstring for its shape."""

    sid: int
    start_s: float
    options: AgentOptions
    rng: random.Random
    context: str = ""
    calls_done: int = 0
    times: list[tuple[float, float]] = field(default_factory=list)  # (sent, last answer)

    @property
    def key(self) -> str:
        return f"agent-session-{self.options.seed}-{self.sid}"

    @property
    def done(self) -> bool:
        return self.calls_done >= self.options.calls

    def next_step(self) -> list[str]:
        """The texts of the next call (one) or its parallel siblings (2-8)."""
        o, rng = self.options, self.rng
        if not self.context:
            self.context = f"system: session {self.sid} " + words(rng, o.system_words)
            self.context += "\nuser: " + words(rng, o.user_words)
        last = self.calls_done == o.calls - 1
        if not last and self.calls_done > 0 and rng.random() < o.fanout_p:
            n = rng.randint(o.fanout_min, o.fanout_max)
            return [f"{self.context}\nsubtask {i}: " + words(rng, 12) for i in range(n)]
        return [self.context]

    def on_answers(self, texts: list[str], answers: list[str]) -> None:
        """All of the step's calls answered: the chain goes on from the first sibling,
        plus the output of the tool it called."""
        o, rng = self.options, self.rng
        self.calls_done += 1
        tool = words(rng, rng.randint(o.tool_min, o.tool_max))
        self.context = f"{texts[0]}\nassistant: {answers[0]}\ntool: {tool}"

    def gap_s(self) -> float:
        """The tool's run time before the next call (already divided by `speedup`)."""
        o = self.options
        gap = math.exp(math.log(o.gap_median_s) + o.gap_sigma * self.rng.gauss(0, 1))
        return min(max(gap, o.gap_min_s), o.gap_max_s) / o.speedup

    def extra_body(self) -> dict[str, object]:
        """What an agent framework adds to each call's body."""
        body: dict[str, object] = {}
        if self.options.keys:
            body["prompt_cache_key"] = self.key
        if self.options.pin_ttl_s > 0:
            body["cache_pin_ttl"] = self.options.pin_ttl_s
        return body


def agent_sessions(options: AgentOptions) -> list[AgentSession]:
    """The workload's sessions in start order (Poisson starts, `session_rate` a second)."""
    rng = random.Random(options.seed)
    t, out = 0.0, []
    for sid in range(options.sessions):
        out.append(AgentSession(sid, t, options, random.Random(f"{options.seed}:{sid}")))
        t += rng.expovariate(options.session_rate)
    return out
