"""The four mutations that once survived the whole relevant test set (issue 36) are each
killed by a named test: each is applied to a copy of the tree and its test run there.

(The sound run of each test is the suite's own; `python -m tests.mutations` runs both
and every other listed mutation, for the score in loadtests/results/mutations.md.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.mutations import MUTATIONS, ROOT, Mutation, copy_tree, killed, mutate

ONCE_SURVIVED = ("evict-exact-fit", "no-echo-first-reuse", "orphan-under-root", "spill-limit")


@pytest.fixture(scope="module")
def tree_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("mutations")
    copy_tree(where)
    return where


def test_every_mutation_still_applies_to_its_line() -> None:
    for m in MUTATIONS:
        text = (ROOT / m.path).read_text()
        assert mutate(text, m) != text, m.name
        assert (ROOT / m.test.split("::")[0]).is_file(), m.test


@pytest.mark.parametrize("name", ONCE_SURVIVED)
def test_the_named_test_kills_the_mutation(name: str, tree_copy: Path) -> None:
    mutation: Mutation = next(m for m in MUTATIONS if m.name == name)
    assert killed(mutation, tree_copy), f"{name} survives {mutation.test}"
