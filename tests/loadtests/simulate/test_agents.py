"""The agent workload (loadtests/load/agents.py) and its simulator (loadtests/simulate/agents.py):
the stated distributions, the ceiling printed beside the hit rate, and the sides' order on
a small fleet where tool gaps meet churn."""

from __future__ import annotations

import math
import statistics
from dataclasses import replace

from loadtests.load.agents import AgentOptions, agent_sessions
from loadtests.simulate.agents import (
    AgentSim,
    background_requests,
    chars_per_token,
    simulate_agents,
)
from loadtests.simulate.simulation import WordTokenizer
from loadtests.simulate.worker import CostModel
from shared.config import RouterConfig


def test_sessions_follow_the_stated_distributions() -> None:
    o = AgentOptions(sessions=40, seed=3)
    agents = agent_sessions(o)
    assert all(o.calls_min <= s.calls <= o.calls_max for s in agents)
    assert len({s.calls for s in agents}) > 5  # drawn, not one k for all
    starts = [len(s.next_step()[0].split()) for s in agents]
    assert all(o.context_min <= n <= o.context_max + o.user_words + 6 for n in starts)
    tools = [s.tool_words() for s in agents for _ in range(50)]
    assert min(tools) >= o.tool_min and max(tools) <= o.tool_max
    # Log-uniform: the median is the geometric mean of the bounds (2,000), not 4,250.
    assert abs(statistics.median(tools) / math.sqrt(o.tool_min * o.tool_max) - 1) < 0.15
    uniform = agent_sessions(replace(o, tool_dist="uniform"))[0]
    assert statistics.mean(uniform.tool_words() for _ in range(2000)) > 3500


def test_a_later_call_extends_the_context_by_the_answer_and_the_tool_output() -> None:
    s = agent_sessions(AgentOptions(sessions=1, fanout_p=0.0))[0]
    first = s.next_step()
    s.on_answers(first, ["an answer"])
    second = s.next_step()
    assert len(second) == 1 and second[0].startswith(first[0] + "\nassistant: an answer\ntool: ")


def _small(keys: bool, pins: bool) -> dict[str, object]:
    """Six sessions of 1-3k-token starts on 2 workers of 12k KV, tool gaps of 1-10 s,
    beside traffic of one-off prompts that churns the caches in every gap."""
    o = AgentOptions(
        sessions=6, calls_min=4, calls_max=6, session_rate=1.0, context_min=1000,
        context_max=3000, tool_min=50, tool_max=800, output_tokens=8, gap_median_s=4.0,
        gap_min_s=1.0, gap_max_s=10.0, fanout_p=0.3, fanout_max=3, keys=keys,
        pin_ttl_s=10.0 if pins else 0.0, seed=1,
    )  # fmt: skip
    cost = CostModel(cache_tokens=12_000, max_running=8)
    if pins:
        cost = replace(cost, pin_budget=0.6, pin_max_ttl_s=10.0)
    churn = background_requests(120, 4.0, seed=1, groups=120)
    config = RouterConfig(policy="cache_aware")
    return simulate_agents("x", config, 2, cost, o, background=churn).row()


def test_pins_keep_contexts_through_churn_and_no_side_beats_the_ceiling() -> None:
    today, pinned = _small(keys=False, pins=False), _small(keys=True, pins=True)
    assert today["ceiling_after_first"] == pinned["ceiling_after_first"]  # the same sessions
    for row in (today, pinned):
        assert row["hit_after_first"] <= row["ceiling_after_first"] + 1e-9
    assert pinned["reuse_after_first"] > today["reuse_after_first"]
    assert pinned["siblings_colocated"] == 1.0


def test_the_jct_breakdown_adds_up_to_the_jct_and_prefill_follows_the_misses() -> None:
    """Gaps + queue + prefill + decode is each session's JCT (the last-answered call of
    each step on its critical path); keys+pins prefill fewer tokens than today."""
    today, pinned = _small(keys=False, pins=False), _small(keys=True, pins=True)
    for row in (today, pinned):
        parts = sum(row[f"{p}_mean_s"] for p in ("gaps", "queue", "prefill", "decode"))  # type: ignore[misc]
        assert math.isclose(parts, row["jct_mean_s"], rel_tol=1e-9)  # type: ignore[arg-type]
        assert min(row[f"{p}_mean_s"] for p in ("queue", "prefill", "decode")) >= 0  # type: ignore[type-var]
        assert 0 < row["busy"] < 1  # type: ignore[operator]
    assert today["gaps_mean_s"] == pinned["gaps_mean_s"]  # the same sessions, the same gaps
    assert pinned["prefilled_tokens"] < today["prefilled_tokens"]  # type: ignore[operator]


def test_the_routers_tree_counts_the_workloads_own_chars_per_token() -> None:
    """The simulated router caps its tree at the texts' own chars per token, as a live
    router calibrates it from its first answers (router/holdings/calibration.py); the
    default guess (4.0) made its tree forget what the workers held (5.0 here)."""
    o = AgentOptions(sessions=4, seed=2)
    churn = background_requests(20, 4.0, seed=1, groups=20)
    texts = [s.next_step()[0] for s in agent_sessions(o)] + [t for _, t in churn]
    words = sum(len(t.split()) for t in texts)
    ratio = chars_per_token(o, churn, WordTokenizer())
    assert ratio == sum(map(len, texts)) / words
    assert 4.5 < ratio < 5.5


def test_the_simulated_replicas_tables_agree_as_the_proxys_do() -> None:
    """The simulator builds each replica's session table as the proxy does
    (router/upstream/proxy.py: `replicas` when replica sync is on): a lone router's
    rule 1 picks the least loaded, replicas by the rule they agree on."""
    cost = CostModel(cache_tokens=4096, max_running=4)
    config = RouterConfig(policy="cache_aware")
    lone = AgentSim(config, 2, cost, AgentOptions(sessions=0))
    pair = AgentSim(config, 2, cost, AgentOptions(sessions=0), replicas=2)
    assert [t.agree for _, t in lone.replicas] == [False]
    assert [t.agree for _, t in pair.replicas] == [True, True]
