"""LoRA adapters on the wire: a worker's record advertises them, a `/v1/models` answer
names them (vLLM lists each with a `parent`), and KV events say which adapter computed
a block (`lora_name`, or `lora_id` alone), all bounded as untrusted input."""

from __future__ import annotations

import msgpack
import pytest

from shared.wire.kv_events import BlockStored, decode_batch, encode_batch
from shared.wire.peers import served_adapters, served_model
from shared.wire.registry import MAX_ADAPTERS, WorkerRecord, fit_adapters

# vLLM 0.32's answer with `--served-model-name tiny --lora-modules ad-a=/path` (trimmed).
VLLM_MODELS = {
    "object": "list",
    "data": [
        {"id": "tiny", "object": "model", "root": "/m/tiny", "parent": None},
        {"id": "ad-a", "object": "model", "root": "/m/lora", "parent": "tiny"},
    ],
}


def test_the_base_model_and_its_adapters_from_vllms_model_list() -> None:
    assert served_model(VLLM_MODELS) == "tiny"
    assert served_adapters(VLLM_MODELS) == ["ad-a"]
    adapters_first = {"data": VLLM_MODELS["data"][::-1]}
    assert served_model(adapters_first) == "tiny"  # the entry without a parent
    assert served_adapters({"data": [{"id": "m"}]}) == [] and served_adapters({"data": 5}) == []


def test_a_record_carries_its_adapters_and_bounds_them() -> None:
    rec = WorkerRecord("w1", "http://127.0.0.1:9", "tiny", "vllm", 1.0, adapters=("a", "b"))
    raw = rec.to_hash()
    assert raw["adapters"] == "a,b"
    assert WorkerRecord.from_hash(raw) == rec
    assert WorkerRecord.from_hash({**raw, "adapters": ""}).adapters == ()
    for bad in (",".join(f"a{i}" for i in range(MAX_ADAPTERS + 1)), "a,,b", "a,\x07"):
        with pytest.raises(ValueError):
            WorkerRecord.from_hash({**raw, "adapters": bad})
    with pytest.raises(ValueError, match="too long"):
        WorkerRecord.from_hash({**raw, "adapters": "x" * 2000})
    # What the sidecar keeps of a long list: names that fit, in order; no "," in a name.
    kept = fit_adapters(["a,b", *(f"adapter-{i:03d}" for i in range(100))])
    assert kept[0] == "adapter-000" and len(kept) == MAX_ADAPTERS
    assert WorkerRecord.from_hash({**raw, "adapters": ",".join(kept)}).adapters == kept
    assert len(fit_adapters(["y" * 256] * 10)) == 3  # 3 x 257 - 1 <= 1024 chars


def _batch(event: dict[str, object]) -> bytes:
    return msgpack.packb([1.0, [event]], use_bin_type=True)


STORED = {
    "type": "BlockStored", "block_hashes": [7, 8], "parent_block_hash": None,
    "token_ids": list(range(8)), "block_size": 4, "medium": "GPU",
}  # fmt: skip


def test_stored_blocks_name_their_adapter_in_any_of_vllms_forms() -> None:
    # vLLM 0.32 (recorded from a CPU `vllm serve --enable-lora`): id, name and the name
    # again in every block's extra_keys.
    now = {**STORED, "lora_id": 1, "lora_name": "ad-a", "extra_keys": [["ad-a"], ["ad-a"]]}
    event = decode_batch(_batch(now)).events[0]
    assert isinstance(event, BlockStored) and event.lora == "ad-a"
    # A schema with `lora_id` only (no lora_name, no extra_keys), as an array.
    older = ["BlockStored", [7, 8], None, list(range(8)), 4, 3, "GPU"]
    assert decode_batch(msgpack.packb([1.0, [older]])).events[0].lora == 3  # type: ignore[union-attr]
    base = {**STORED, "lora_id": None, "lora_name": None, "extra_keys": [None, None]}
    assert decode_batch(_batch(base)).events[0].lora is None  # type: ignore[union-attr]
    assert decode_batch(_batch({**STORED, "lora_id": 0})).events[0].lora is None  # type: ignore[union-attr]
    for bad in ({"lora_name": 5}, {"lora_name": ""}, {"lora_id": -1}, {"lora_id": "1"},
                {"lora_name": "x" * 300}):  # fmt: skip
        with pytest.raises(ValueError):
            decode_batch(_batch({**STORED, **bad}))


def test_the_sidecars_re_encoding_keeps_the_adapter() -> None:
    for lora in ("ad-a", 3, None):
        event = BlockStored((7, 8), None, list(range(8)), 4, lora=lora)
        assert decode_batch(encode_batch([event])).events[0].lora == lora  # type: ignore[union-attr]
