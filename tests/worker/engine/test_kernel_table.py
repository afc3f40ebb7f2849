"""The attention kernels' block sizes come from one table per head dim, which a file
named by RADIX_KERNEL_TABLE (the GPU check's timed fastest rows) overrides."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from worker.engine.runtime.attention import kernel_table as kt

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kt, "_cache", None)


def test_entries_per_head_dim_and_element_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(kt.ENV, raising=False)
    assert kt.blocks_for(64, 2) == kt.TABLE[(64, 2)]
    assert kt.blocks_for(72, 2) == kt.TABLE[(80, 2)]  # the next larger head dim listed
    assert kt.blocks_for(512, 2) == kt.TABLE[(256, 2)]  # past the largest: the largest
    assert kt.blocks_for(64, 4) == kt.FP32 and kt.blocks_for(128, 4) == kt.FP32_WIDE


def test_a_timed_row_overrides_its_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "kernel-table.json"
    path.write_text(json.dumps([{"head_dim": 64, "element_size": 2, "decode_block_n": 128,
                                 "decode_stages": 4}]))  # fmt: skip
    monkeypatch.setenv(kt.ENV, str(path))
    got = kt.blocks_for(64, 2)
    assert (got.decode_block_n, got.decode_stages) == (128, 4)
    assert got.extend_rows == kt.TABLE[(64, 2)].extend_rows  # fields not given: the table's
    assert kt.blocks_for(128, 2) == kt.TABLE[(128, 2)]


def test_the_module_prints_the_table_in_the_override_format() -> None:
    done = subprocess.run([sys.executable, "-m", "worker.engine.runtime.attention.kernel_table"],
                          cwd=REPO, capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    rows = json.loads(done.stdout)
    assert {(r["head_dim"], r["element_size"]) for r in rows} >= {(64, 2), (128, 2), (64, 4)}
    assert all(set(r) == {"head_dim", "element_size", *kt.Blocks.__dataclass_fields__}
               for r in rows)  # fmt: skip
