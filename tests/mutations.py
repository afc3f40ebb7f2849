"""Mutation check: small deliberate bugs in core rules, each of which a named test must catch.

    python -m tests.mutations            # every mutation; prints the score, exit 1 if one survives
    python -m tests.mutations evict-exact-fit spill-limit   # some, by name
    python -m tests.mutations --list

For each mutation: copy router/, worker/, shared/, tests/ and loadtests/ into a
temporary folder, run the named test there (it must pass on the sound copy, else the
check proves nothing), apply the one-line change to the copy, run the test again: it
must fail ("killed").
The working tree is never touched. A mutation whose line is gone (the code moved on)
is an error, not a pass: update its `old` text with the code.

The first four survived the whole relevant test set once (issue 36), and two more were
found surviving here (drop-worker-keeps-host-blocks, host-evict-exact-fit); the rest
are core rules the suite already guarded, kept so the score covers the same ground.
Score and history: loadtests/results/mutations.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COPIED = ("router", "worker", "shared", "tests", "loadtests")  # tests import loadtests helpers
NEAR_LINES = 40


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # relative to the repository root
    anchor: str  # the mutation is the first `old` after this text
    old: str
    new: str
    test: str  # pytest node id that must fail on the mutant


MUTATIONS = (
    Mutation(
        "evict-exact-fit",
        "worker/engine/radix_cache.py",
        "Free at least `num_tokens` device slots",
        "while freed < num_tokens",
        "while freed <= num_tokens",
        "tests/worker/engine/test_radix_cache.py::test_an_exact_fit_evicts_one_leaf_and_no_more",
    ),
    Mutation(
        "no-echo-first-reuse",
        "router/upstream/answer_reader.py",
        "def _take_head(",
        "self.exchanges > 1",
        "self.exchanges > 2",
        "tests/router/upstream/test_upstream_client.py"
        "::test_the_first_reuse_of_a_connection_must_echo_the_request_id",
    ),
    Mutation(
        "orphan-under-root",
        "router/holdings/kv_index.py",
        "self.orphans += len(event.block_hashes)",
        "return",
        "known = 0",
        "tests/router/holdings/test_merge_tiers.py::test_an_orphan_block_is_dropped_and_never_matched",
    ),
    Mutation(
        "spill-limit",
        "router/policy/cache_aware.py",
        "holders = [j for j in self._holders(above)",
        "loads[j] <= limit",
        "loads[j] < limit",
        "tests/router/policy/test_policy.py"
        "::test_per_request_spill_takes_a_holder_loaded_exactly_at_the_limit",
    ),
    Mutation(
        "lock-leaks",
        "worker/engine/radix_cache.py",
        "unlock of an unlocked node",
        "node.lock_ref -= 1",
        "node.lock_ref -= 0",
        "tests/worker/engine/test_radix_cache.py"
        "::test_locked_path_is_never_evicted_and_reset_keeps_it",
    ),
    Mutation(
        "evict-most-recent",
        "worker/engine/radix_cache.py",
        "Free at least `num_tokens` device slots",
        "if node.last_access != tick:",
        "if False:",
        "tests/worker/engine/test_radix_cache.py::test_evicts_least_recently_used_leaf_first",
    ),
    Mutation(
        "imbalance-either-threshold",
        "router/policy/cache_aware.py",
        "if self._fleet:\n            high = max(loads)",
        "high - low > self._abs and high",
        "high - low > self._abs or high",
        "tests/router/policy/test_policy.py::test_imbalance_thresholds_are_strict",
    ),
    Mutation(
        "drop-worker-keeps-host-blocks",
        "router/holdings/kv_index.py",
        "class Dropping:",
        "unhold(worker, key, 7)",
        "unhold(worker, key, 1)",
        "tests/router/holdings/test_merge_tiers.py::test_a_dropped_worker_holds_nothing_in_any_tier",
    ),
    Mutation(
        "host-evict-exact-fit",
        "worker/engine/hiradix_cache.py",
        "def _evict_host(self, num_tokens: int) -> int:",
        "while freed < num_tokens",
        "while freed <= num_tokens",
        "tests/worker/engine/test_host_tier.py::test_an_exact_fit_drops_one_host_leaf_and_no_more",
    ),
    Mutation(
        "reuse-without-echo",
        "router/upstream/answer_reader.py",
        "def _take_head(",
        "if echo is not None and echo != self.request_id:",
        "if False:",
        "tests/router/upstream/test_upstream_desync.py",
    ),
)


def mutate(text: str, m: Mutation) -> str:
    """`text` with the first `m.old` after `m.anchor` replaced; ValueError if either is gone."""
    at = text.find(m.anchor)
    if at < 0:
        raise ValueError(f"{m.name}: anchor {m.anchor!r} not in {m.path}")
    hit = text.find(m.old, at)
    # Near its anchor only: a far hit is some other function's line.
    if hit < 0 or text.count("\n", at, hit) > NEAR_LINES:
        raise ValueError(f"{m.name}: {m.old!r} not within {NEAR_LINES} lines after its anchor")
    return text[:hit] + m.new + text[hit + len(m.old) :]


def copy_tree(dest: Path) -> None:
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache", ".hypothesis")
    for name in COPIED:
        shutil.copytree(ROOT / name, dest / name, ignore=skip)
    for name in ("pyproject.toml", "README.md"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, dest / name)


def run_test(where: Path, test: str) -> bool:
    """True when `test` passes in the tree at `where`."""
    env = {**os.environ, "PYTHONPATH": str(where), "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", test],
        cwd=where,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return done.returncode == 0


def killed(m: Mutation, where: Path) -> bool:
    """Whether `m.test` fails once `m` is applied to the copy at `where` (undone after)."""
    path = where / m.path
    sound = path.read_text()
    path.write_text(mutate(sound, m))
    try:
        return not run_test(where, m.test)
    finally:
        path.write_text(sound)


def check(m: Mutation, where: Path) -> str:
    """ "killed", "survived", or "vacuous" (the test fails on the sound copy too). `where`
    holds a fresh copy of the tree; the mutation is undone afterwards."""
    if not run_test(where, m.test):
        return "vacuous"
    return "killed" if killed(m, where) else "survived"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.mutations", description=__doc__)
    parser.add_argument("names", nargs="*", help="mutations to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    args = parser.parse_args(argv)
    known = {m.name: m for m in MUTATIONS}
    if args.list:
        for m in MUTATIONS:
            print(f"{m.name:28} {m.path}: {m.old!r} -> {m.new!r}\n{'':28} {m.test}")
        return 0
    unknown = [n for n in args.names if n not in known]
    if unknown:
        parser.error(f"unknown mutation(s): {', '.join(unknown)}")
    chosen = [known[n] for n in args.names] or list(MUTATIONS)
    results: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="mutations-") as tmp:
        where = Path(tmp)
        copy_tree(where)
        for m in chosen:
            results[m.name] = check(m, where)
            print(f"{results[m.name]:9} {m.name:28} {m.test}", flush=True)
    killed = sum(r == "killed" for r in results.values())
    print(f"score: {killed}/{len(results)} killed")
    return 0 if killed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
