"""The serving process's collector settings (shared/serving/gc_policy.py)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from shared.serving.gc_policy import GEN0, GEN1, GEN2, freeze_startup, tune_for_serving


@pytest.fixture
def restored_gc() -> Iterator[None]:
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


class _Node:
    me: object


def test_frozen_objects_are_out_of_every_collection(restored_gc: None) -> None:
    node = _Node()
    node.me = node  # a cycle alive at start-up
    dead = weakref.ref(node)
    assert freeze_startup() > 0
    del node  # unreachable now, but frozen: no collection visits it
    gc.collect()
    assert dead() is not None
    gc.unfreeze()
    gc.collect()
    assert dead() is None


def test_thresholds_for_serving(restored_gc: None) -> None:
    tune_for_serving()
    assert gc.get_threshold() == (GEN0, GEN1, GEN2)
    assert GEN0 > 700  # the interpreter's default collected every ~26 requests
