"""Fixtures for tests/gpu alone. The GPU check runs these tests with
`--confcutdir tests/gpu`, so the repository's top-level conftest (which imports redis,
absent on the GPU machine) is not loaded there; this file gives them what they use."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama (untied embeddings), as tests/conftest.py makes it."""
    from worker.models.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), arch="llama")
