"""A Hugging Face `config.json` (plus `generation_config.json`) as a frozen dataclass.

Only the Llama family is supported (Llama, Mistral, Qwen2, Qwen3): every field the decoder
needs is read here once, with the same defaults transformers uses, so the model code
never looks at a raw dict. Unsupported features are errors at load time, not wrong
logits later.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: `linear` (position interpolation) or `llama3`."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2 always; Llama when `attention_bias`
    o_bias: bool  # Llama `attention_bias` only
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k before RoPE
    sliding_window: int | None  # Mistral: a token sees only the last `sliding_window` keys
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None

    @property
    def max_model_len(self) -> int:
        return self.max_position_embeddings

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        model_dir = Path(model_dir)
        path = model_dir / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in {model_dir}")
        raw = json.loads(path.read_text())
        gen_path = model_dir / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
        return cls.from_dict(raw, gen)

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], generation: dict[str, Any] | None = None
    ) -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}; only 'silu' (SwiGLU) is supported")
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ValueError(
                f"num_attention_heads {heads} is not a multiple of kv heads {kv_heads}"
            )
        # Mistral configs carry "head_dim": null; transformers then derives it.
        head_dim = int(raw.get("head_dim") or hidden // heads)
        rope_theta, rope_scaling = _parse_rope(raw)
        attention_bias = bool(raw.get("attention_bias", False))
        max_len = int(raw.get("max_position_embeddings", 2048))
        window = _sliding_window(raw, model_type, max_len)
        return cls(
            model_type=model_type,
            architecture=(raw.get("architectures") or [""])[0],
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=max_len,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type != "qwen2" and attention_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            sliding_window=window,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_eos_ids(raw.get("eos_token_id"), (generation or {}).get("eos_token_id")),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        )


def _sliding_window(raw: dict[str, Any], model_type: str, max_len: int) -> int | None:
    """Mistral's window (every layer) is supported by both attention backends. Qwen's
    is per layer (`max_window_layers`) and is refused rather than run wrong."""
    window = raw.get("sliding_window")
    if model_type == "mistral":
        return int(window) if window and int(window) < max_len else None
    if window and raw.get("use_sliding_window"):
        raise ValueError(
            f"{model_type} with use_sliding_window=true is not supported (per-layer "
            "sliding windows); only Mistral's all-layer sliding window is"
        )
    return None


def _eos_ids(*values: int | list[int] | None) -> tuple[int, ...]:
    """Union of config.json and generation_config.json eos ids, order kept."""
    ids: list[int] = []
    for value in values:
        for v in value if isinstance(value, list) else [value]:
            if v is not None and int(v) not in ids:
                ids.append(int(v))
    return tuple(ids)


def _parse_rope(raw: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """Reads both the classic (`rope_theta` + `rope_scaling`) and the transformers 5
    (`rope_parameters`) spellings."""
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or params
    theta = float(raw.get("rope_theta") or params.get("rope_theta") or 10000.0)
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope_scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    if rope_type == "linear":
        return theta, RopeScaling(rope_type="linear", factor=float(scaling["factor"]))
    return theta, RopeScaling(
        rope_type="llama3",
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
    )
