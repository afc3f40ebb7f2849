"""The approximate prefix tree: the docstring's worked example, a brute-force
reference, LRU eviction by ``now``, caps, the global budget, token ids."""

from __future__ import annotations

import random
import textwrap
import tracemalloc
from itertools import pairwise

from hypothesis import given, settings
from hypothesis import strategies as st

from router.holdings import tree as tree_module
from router.holdings.tree import PrefixTree
from shared.tokens.prompt_ids import token_key

WORKED_EXAMPLE = """\
'hel' a@3 b@2
  'lo ' a@1 b@2
    'there' b@2
    'world' a@1
  'p' a@3"""


def test_worked_example_from_docstring() -> None:
    tree: PrefixTree[str] = PrefixTree()
    tree.insert("hello world", "a", now=1)
    tree.insert("hello there", "b", now=2)
    tree.insert("help", "a", now=3)
    assert tree.dump() == WORKED_EXAMPLE
    assert tree.match("hello thx") == {"b": 8, "a": 6}
    assert tree.tenant_size("a") == 12
    assert tree.tenant_size("b") == 11
    assert tree.total_chars == len("hel" + "lo " + "there" + "world" + "p")
    # The path the match walks: holders of each node root side first, with the matched
    # length at its end ('th' of 'there' for the last, where the text leaves it).
    path = [(sorted(held), end) for held, end in tree.match_path("hello thx")]
    assert path == [(["a", "b"], 3), (["a", "b"], 6), (["b"], 8)]
    assert tree.match_path("zzz") == [] and tree.match_path("") == []
    assert tree.tenant_sizes(["a", "b", "nobody"]) == [12, 11, 0]
    tree.check_integrity()
    # The docstring shows this very tree, so the documentation cannot drift from the code.
    assert textwrap.indent(WORKED_EXAMPLE, "    ") in (tree_module.__doc__ or "")


def test_match_edges() -> None:
    tree: PrefixTree[str] = PrefixTree()
    assert tree.match("anything") == {}
    tree.insert("abc", "a", now=1)
    assert tree.match("") == {}
    assert tree.match("abc") == {"a": 3}
    assert tree.match("abcdef") == {"a": 3}  # text longer than anything stored
    assert tree.match("ab") == {"a": 2}  # text ends inside a node
    assert tree.match("xbc") == {}
    tree.insert("abc", "a", now=2)  # idempotent apart from the time
    assert tree.dump() == "'abc' a@2"


def _lcp(a: str | tuple[int, ...], b: str | tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


texts = st.text(alphabet="abc", min_size=0, max_size=12)
ops = st.lists(st.tuples(texts, st.sampled_from(["x", "y", "z"])), max_size=30)


@settings(max_examples=300, deadline=None)
@given(ops=ops, queries=st.lists(texts, max_size=10))
def test_match_equals_brute_force(ops: list[tuple[str, str]], queries: list[str]) -> None:
    tree: PrefixTree[str] = PrefixTree()
    held: dict[str, list[str]] = {}
    for now, (text, tenant) in enumerate(ops):
        tree.insert(text, tenant, now)
        held.setdefault(tenant, []).append(text)
        tree.check_integrity()
    for q in queries + [t for t, _ in ops]:
        expected = {t: max(_lcp(q, s) for s in ss) for t, ss in held.items()}
        assert tree.match(q) == {t: n for t, n in expected.items() if n > 0}
    for tenant, ss in held.items():  # logical size = distinct chars of its own trie
        prefixes = {s[:i] for s in ss for i in range(1, len(s) + 1)}
        assert tree.tenant_size(tenant) == len(prefixes)


@settings(max_examples=200, deadline=None)
@given(ops=ops, cap=st.integers(0, 20), budget=st.integers(1, 40))
def test_bounded_tree_stays_consistent(ops: list[tuple[str, str]], cap: int, budget: int) -> None:
    """With eviction the answer may only shrink (never invent a match) and bounds hold."""
    tree: PrefixTree[str] = PrefixTree(max_chars=budget, hysteresis=0.25)
    tree.set_cap("x", cap)
    held: dict[str, list[str]] = {}
    for now, (text, tenant) in enumerate(ops):
        tree.insert(text, tenant, now)
        held.setdefault(tenant, []).append(text)
        tree.check_integrity()
        assert tree.total_chars <= budget
        assert tree.tenant_size("x") <= cap
        for q in {t for t, _ in ops}:
            for t, n in tree.match(q).items():
                assert n <= max(_lcp(q, s) for s in held[t])


# Routing's order: a match, then the insert of the same text object (which goes on from
# the match's last node). Interleaved with other inserts, matches and removals (splits
# and detaches that move that node), and under caps, so the LRU order shows in evictions.
steps = st.lists(
    st.tuples(
        st.sampled_from(["match_insert", "match", "insert", "remove"]),
        st.integers(0, 2),  # which text object (the same object recurs)
        st.sampled_from(["x", "y", "z"]),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(pool=st.lists(texts, min_size=3, max_size=3), steps=steps, cap=st.integers(1, 20))
def test_an_insert_after_its_match_builds_the_tree_a_bare_insert_builds(
    pool: list[str], steps: list[tuple[str, int, str]], cap: int
) -> None:
    walked: PrefixTree[str] = PrefixTree(max_chars=30, hysteresis=0.25)
    bare: PrefixTree[str] = PrefixTree(max_chars=30, hysteresis=0.25)
    for tree in (walked, bare):
        tree.set_cap("x", cap)
    for now, (kind, i, tenant) in enumerate(steps):
        text = pool[i]
        if kind == "remove":
            walked.remove_tenant(tenant)
            bare.remove_tenant(tenant)
            continue
        if kind != "insert":
            assert walked.match_path(text) == bare.match_path(text[:])
        if kind != "match":
            walked.insert(text, tenant, now)
            bare.insert("".join(text), tenant, now)  # an equal text, not the same object
        walked.check_integrity()
        assert walked.dump() == bare.dump()
        for t in ("x", "y", "z"):
            assert walked.tenant_size(t) == bare.tenant_size(t)


def test_a_split_or_a_detach_after_the_match_is_followed_by_the_insert() -> None:
    """The match's last node moved before the insert: cut by another text's insert, or
    detached with a tenant. The insert still builds the tree a bare insert builds."""
    for between in ("split", "detach"):
        walked: PrefixTree[str] = PrefixTree()
        bare: PrefixTree[str] = PrefixTree()
        text = "".join(["abc", "def"])  # an object of its own
        for tree in (walked, bare):
            tree.insert("abcd", "x", now=1)
        walked.match_path(text)  # ends in node 'abcd', at 4
        for tree in (walked, bare):
            if between == "split":
                tree.insert("abzz", "y", now=2)  # 'abcd' becomes 'ab' + 'cd'
            else:
                tree.remove_tenant("x")  # 'abcd' leaves the tree
            tree.insert(text if tree is walked else "abcdef", "z", now=3)
        walked.check_integrity()
        assert walked.dump() == bare.dump(), between


def test_token_ids_use_the_same_tree() -> None:
    tree: PrefixTree[tuple[int, ...]] = PrefixTree()
    tree.insert((1, 2, 3, 4), "x", now=1)
    tree.insert((1, 2, 5), "y", now=2)
    assert tree.match((1, 2, 3, 9)) == {"x": 3, "y": 2}
    assert tree.match((7,)) == {}
    assert tree.dump() == "(1, 2) x@1 y@2\n  (3, 4) x@1\n  (5,) y@2"
    tree.check_integrity()


id_lists = st.lists(st.sampled_from([1, 2, 3, 0x10001, 0x20001, 2**31 - 1]), max_size=10)


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(id_lists, st.sampled_from(["x", "y"])), max_size=20),
       queries=st.lists(id_lists, max_size=6), cap=st.integers(0, 12))  # fmt: skip
def test_token_keys_match_and_count_whole_ids(
    ops: list[tuple[list[int], str]], queries: list[list[int]], cap: int
) -> None:
    """A width-4 tree over TokenKeys answers as a tuple tree over the same ids: ids that
    share low bytes (1, 0x10001, 0x20001) part inside an id, and that never counts."""
    keyed: PrefixTree[str] = PrefixTree(width=4)
    plain: PrefixTree[tuple[int, ...]] = PrefixTree()
    capped: PrefixTree[str] = PrefixTree(width=4)  # a cap in ids holds, in ids
    capped.set_cap("y", cap)
    for now, (ids, tenant) in enumerate(ops):
        key = token_key(ids)
        assert key is not None and len(key) == 4 * len(ids)
        keyed.insert(key, tenant, now)
        plain.insert(tuple(ids), tenant, now)
        capped.insert(key, tenant, now)
        keyed.check_integrity()
        capped.check_integrity()
        assert capped.tenant_size("y") <= cap
    for q in queries + [ids for ids, _ in ops]:
        assert keyed.match(token_key(q)) == plain.match(tuple(q))  # type: ignore[arg-type]
        path = keyed.match_path(token_key(q))  # type: ignore[arg-type]
        ends = [e for _, e in path]
        assert all(0 < e1 < e2 for e1, e2 in pairwise(ends))
    # Sizes are elements / 4: where two ids part inside an id, the low bytes they share are
    # stored (and counted) once, so a size may be under the ids' by under an id a node.
    for tenant in ("x", "y"):
        size = keyed.tenant_size(tenant)
        assert size <= plain.tenant_size(tenant) <= size + keyed.tenant_nodes(tenant)
    assert keyed.total_chars <= plain.total_chars


def test_eviction_is_lru_by_now_and_refresh_counts() -> None:
    tree: PrefixTree[str] = PrefixTree(hysteresis=0.0)
    tree.insert("aaaa", "t", now=1)
    tree.insert("bbbb", "t", now=2)
    tree.insert("cccc", "t", now=3)
    tree.insert("aaaa", "t", now=4)  # refreshed: now the most recent
    assert tree.evict("t", 1) == 4
    assert tree.match("bbbb") == {}
    assert tree.match("aaaa") == {"t": 4} and tree.match("cccc") == {"t": 4}
    tree.insert("cccc-more", "t", now=5)
    tree.evict("t", 4)  # 'aaaa' (4) goes before the 'cccc' path (5)
    assert tree.dump() == "'cccc' t@5\n  '-more' t@5"
    tree.evict("t", 1)  # leaf first: the tail, keeping the shared head
    assert tree.dump() == "'cccc' t@5"
    tree.check_integrity()


def test_eviction_is_per_tenant_and_keeps_shared_nodes() -> None:
    tree: PrefixTree[str] = PrefixTree()
    tree.insert("shared-prefix/one", "a", now=1)
    tree.insert("shared-prefix/two", "b", now=2)
    tree.evict("a", 100)
    assert tree.tenant_size("a") == 0
    assert tree.match("shared-prefix/one") == {"b": len("shared-prefix/")}
    assert tree.dump() == "'shared-prefix/' b@2\n  'two' b@2"
    tree.check_integrity()


def test_split_halves_are_evicted_together_for_other_tenants() -> None:
    tree: PrefixTree[str] = PrefixTree(hysteresis=0.0)
    tree.insert("abcdef", "a", now=1)
    tree.insert("zzz", "a", now=2)
    tree.insert("abcxyz", "b", now=3)  # splits 'abcdef' held by a
    assert tree.evict("a", 1) == 6  # a's oldest entry is all of 'abcdef', split or not
    assert tree.match("abcdef") == {"b": 3}
    assert tree.match("zzz") == {"a": 3}
    tree.check_integrity()


def test_per_tenant_cap() -> None:
    tree: PrefixTree[str] = PrefixTree(hysteresis=0.1)
    tree.set_cap("a", 1000)
    for i in range(200):
        tree.insert(f"{i:04d}" + "x" * 96, "a", now=i)
        tree.insert(f"{i:04d}" + "y" * 96, "b", now=i)
        assert tree.tenant_size("a") <= 1000
    b_texts = [f"{i:04d}" + "y" * 96 for i in range(200)]
    b_prefixes = {t[:n] for t in b_texts for n in range(1, 101)}
    assert tree.tenant_size("b") == len(b_prefixes)  # the uncapped tenant lost nothing
    assert tree.match("0199" + "x" * 96) == {"a": 100, "b": 4}  # newest kept
    assert tree.match("0000" + "x" * 96)["a"] < 100  # the oldest prompt is gone
    tree.set_cap("b", 500)  # lowering a cap evicts at once
    assert tree.tenant_size("b") <= 500
    tree.check_integrity()


def test_global_budget_under_a_flood_of_unique_long_prompts() -> None:
    budget = 200_000
    rng = random.Random(0)
    system = ["".join(rng.choices("abcdefgh ", k=4000)) for _ in range(4)]
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tree: PrefixTree[str] = PrefixTree(max_chars=budget)
        for i in range(600):  # ~2.4M chars offered, 12× the budget
            text = system[i % 4] + f"{i}:" + "".join(rng.choices("abcdefgh ", k=3000))
            tree.insert(text, f"w{i % 8}", now=i)
            assert tree.total_chars <= budget
        del text
        used = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    tree.check_integrity()
    assert tree.total_chars > budget // 2  # evicts down to the low-water mark, not to zero
    assert used < 3 * budget  # chars are ASCII: 1 byte each, plus node overhead
    last = system[599 % 4]
    assert tree.match(last).get("w7") == len(last)  # the newest prompt is still there


def test_global_budget_evicts_the_oldest_entries_across_tenants() -> None:
    tree: PrefixTree[str] = PrefixTree(max_chars=40, hysteresis=0.0)
    tree.insert("a" * 10, "x", now=1)
    tree.insert("b" * 10, "y", now=2)
    tree.insert("c" * 10, "x", now=3)
    tree.insert("d" * 10, "y", now=4)
    assert tree.total_chars == 40  # at the budget, not above: nothing evicted
    tree.insert("e" * 15, "x", now=5)  # 55 > 40: the two oldest go, whoever holds them
    assert tree.dump() == "'cccccccccc' x@3\n'dddddddddd' y@4\n'eeeeeeeeeeeeeee' x@5"
    assert (tree.tenant_size("x"), tree.tenant_size("y")) == (25, 10)
    tree.check_integrity()


def test_remove_tenant() -> None:
    tree: PrefixTree[str] = PrefixTree()
    tree.insert("common/a-only", "a", now=1)
    tree.insert("common/b-only", "b", now=2)
    tree.set_cap("a", 10_000)
    tree.remove_tenant("a")
    tree.remove_tenant("never-seen")  # no error
    assert tree.match("common/a-only") == {"b": len("common/")}
    assert tree.tenant_size("a") == 0 and "a" not in tree.tenants()
    assert tree.total_chars == len("common/b-only")
    tree.check_integrity()
    tree.remove_tenant("b")
    assert tree.total_chars == 0 and tree.dump() == ""
