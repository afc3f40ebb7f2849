"""Pick the device and dtype the model runs in.

One place decides, so the runner, the KV pool and the tests agree: CUDA when
present, else CPU; `dtype="auto"` means bf16 on CUDA (what serving engines run,
whatever the checkpoint was saved in) and fp32 on CPU (bf16/fp16 matmuls on CPU are
slow and less exact than the reference). `--dtype` overrides both.
"""

from __future__ import annotations

import torch

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def pick_device(device: str = "auto") -> torch.device:
    """`auto` → `cuda` when a GPU is visible, else `cpu`; anything else is taken as is."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    return dev


def parse_dtype(name: str) -> torch.dtype:
    """A dtype from its config spelling (`bfloat16`, `bf16`, `torch.float16`, ...)."""
    key = name.removeprefix("torch.").lower()
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(set(_DTYPES))}")
    return _DTYPES[key]


def pick_dtype(dtype: str, config_dtype: str | None, device: torch.device) -> torch.dtype:
    """`auto` → bf16 on CUDA, fp32 elsewhere; `config_dtype` (the checkpoint's) is not
    used by `auto`: an fp32 checkpoint still serves in bf16 on a GPU."""
    del config_dtype
    if dtype != "auto":
        return parse_dtype(dtype)
    return torch.bfloat16 if device.type == "cuda" else torch.float32
