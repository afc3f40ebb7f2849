"""Load a Hugging Face checkpoint (`*.safetensors`, sharded or not) into `CausalLM`.

The module is built on the meta device (no memory, no random init: an 8B model
would spend minutes in init on CPU) and the checkpoint tensors are assigned
straight in, read from disk onto the target device and cast to the target dtype.
Then q/k/v (and on GPUs gate/up) are merged into one matmul each (`fuse=False`
keeps the checkpoint's layout, e.g. to compare the two).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from worker.engine.model_config import ModelConfig
from worker.engine.runtime.model import CausalLM

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The shards named by `model.safetensors.index.json`, else every `*.safetensors`."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{INDEX_FILE} names missing shards: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    return files


def iter_tensors(files: list[Path], device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        # safetensors maps the file and copies each tensor straight onto `device`.
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)


def _is_ignored(name: str, config: ModelConfig) -> bool:
    # Old checkpoints store RoPE tables; tied checkpoints sometimes store lm_head too.
    return name.endswith("rotary_emb.inv_freq") or (
        config.tie_word_embeddings and name == "lm_head.weight"
    )


def load_model(
    model_dir: str | Path,
    config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    *,
    fuse: bool = True,
) -> CausalLM:
    """Build the decoder for `config` and fill it from `model_dir`; eval mode, no grads."""
    with torch.device("meta"):
        model = CausalLM(config)
    expected = dict(model.state_dict())
    state: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    for name, tensor in iter_tensors(safetensors_files(model_dir), device):
        if _is_ignored(name, config):
            continue
        if name not in expected:
            unexpected.append(name)
            continue
        if tensor.shape != expected[name].shape:
            raise ValueError(
                f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, "
                f"config implies {tuple(expected[name].shape)}"
            )
        state[name] = tensor.to(dtype)
    missing = sorted(set(expected) - set(state))
    if unexpected or missing:
        raise ValueError(
            f"checkpoint in {model_dir} does not fit {config.architecture or config.model_type}: "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    model.load_state_dict(state, strict=True, assign=True)
    # Only the RoPE buffer is left on CPU; parameters are already on `device`.
    model.to(device)
    model.eval().requires_grad_(False)
    if fuse:
        model.fuse_projections(gate_up=device.type != "cpu")
    return model
