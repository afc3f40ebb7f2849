"""Make a random-weight Llama / Qwen2 / Qwen3 model folder, entirely offline.

The folder looks like a Hugging Face checkpoint (config.json, safetensors with HF
parameter names, tokenizer.json, tokenizer_config.json with a ChatML template,
generation_config.json), so transformers, vLLM and our engine all load it. The
tokenizer is a byte-level BPE trained here on a generated English corpus: any text
(emoji included) encodes, and common words are single tokens, like a real model.

Weights are drawn with std 1/sqrt(fan_in) (embeddings std 1), not the usual 0.02:
logits then spread over several units, so greedy decoding is not a coin toss
between near-equal tokens and comparisons against transformers are meaningful.

Presets: `tiny` for tests, `bench` for the CPU engine benchmark, and the real shapes
of Qwen2.5-0.5B, Llama-3.2-1B and Qwen3-0.6B (for GPU checks where nothing can be
downloaded; `device="cuda"` draws the weights on the GPU).
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from worker.engine.model_config import ModelConfig
from worker.engine.runtime.device import parse_dtype
from worker.engine.runtime.model import CausalLM
from worker.models.model_presets import ARCHS, PRESETS

__all__ = ["ARCHS", "PRESETS", "make_tiny_model"]

BOS, EOS, IM_START, IM_END = "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (BOS, EOS, IM_START, IM_END)

# ChatML; BOS first like Llama 3, so chat prompts are encoded without adding specials.
CHAT_TEMPLATE = """{{ bos_token }}{% for message in messages %}
{{ '<|im_start|>' + message['role'] + '\\n' }}{% if message['content'] is string %}
{{ message['content'] }}{% elif message['content'] is not none %}
{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}
{% endif %}
{{ '<|im_end|>\\n' }}{% endfor %}
{% if add_generation_prompt %}
{{ '<|im_start|>assistant\\n' }}{% endif %}"""

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM"}  # fmt: skip

_SUBJECTS = ("the cat", "a dog", "my friend", "the teacher", "our team", "the old man", "a child",
             "the router", "the server", "the model", "a student", "the city", "the river")  # fmt: skip
_VERBS = ("sees", "likes", "finds", "builds", "reads", "writes", "moves", "sends", "keeps",
          "opens", "answers", "caches", "serves", "routes", "learns")  # fmt: skip
_OBJECTS = ("a red ball", "the long road", "three books", "the small house", "a quiet song",
            "the prompt", "every request", "the blue sky", "fresh bread", "a café au lait",
            "the naïve plan", "a warm day", "the next token", "many questions")  # fmt: skip
_TAILS = ("today.", "in the morning.", "with care.", "again and again.", "before noon.",
          "because it is fun.", "quickly.", "at home.", "on Monday.", "🙂", "for 42 minutes.")  # fmt: skip


def make_corpus(seed: int = 0, sentences: int = 3000) -> list[str]:
    """Simple English sentences (plus a few accents and an emoji), reproducibly."""
    rng = random.Random(seed)
    lines = []
    for i in range(sentences):
        s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}"
        lines.append(s.capitalize() if i % 2 else f"Q{i}: {s} A: yes, {rng.choice(_SUBJECTS)}.")
    return lines


def train_tokenizer(vocab_size: int, seed: int = 0) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(make_corpus(seed), trainer)
    bos_id = tok.token_to_id(BOS)
    # Like Llama 3: encode() with special tokens prepends BOS.
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
            ),
        ]
    )
    return tok


def _hf_config(arch: str, shape: dict[str, Any], tok: Tokenizer, vocab_size: int,
               rope_theta: float, rope_scaling: dict[str, Any] | None, tied: bool,
               dtype: str) -> dict[str, Any]:  # fmt: skip
    cfg: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": vocab_size,
        "hidden_size": shape["hidden_size"],
        "intermediate_size": shape["intermediate_size"],
        "num_hidden_layers": shape["num_layers"],
        "num_attention_heads": shape["num_heads"],
        "num_key_value_heads": shape["num_kv_heads"],
        "head_dim": shape["head_dim"],
        "hidden_act": "silu",
        "max_position_embeddings": shape["max_position_embeddings"],
        "rms_norm_eps": 1e-5,
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": tied,
        "bos_token_id": tok.token_to_id(BOS),
        "eos_token_id": tok.token_to_id(EOS),
        "torch_dtype": dtype,
        "use_cache": True,
    }
    if arch != "llama":
        cfg |= {"use_sliding_window": False, "sliding_window": None,
                "max_window_layers": shape["num_layers"]}  # fmt: skip
    if arch != "qwen2":
        cfg |= {"attention_bias": False, "mlp_bias": False}
    return cfg


def _random_weights(
    config: ModelConfig, seed: int, device: str, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Drawn in fp32 on `device` (a GPU draws a 1B model in a second; the CPU gives the
    same weights for a seed as it always has), cast to `dtype`, handed back on the CPU
    for saving."""
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.device("meta"):
        shapes = {name: t.shape for name, t in CausalLM(config).state_dict().items()}
    out: dict[str, torch.Tensor] = {}
    for name in sorted(shapes):
        shape = shapes[name]
        t = torch.randn(shape, generator=gen, device=device)
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * t
        elif name.endswith("bias"):
            t = 0.1 * t
        elif "embed_tokens" not in name:
            t = t / math.sqrt(shape[1])
        out[name] = t.to(dtype).contiguous().cpu()
    return out


def _save_weights(out: Path, tensors: dict[str, torch.Tensor], num_shards: int) -> None:
    if num_shards == 1:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    names = sorted(tensors)
    weight_map: dict[str, str] = {}
    for i in range(num_shards):
        file = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::num_shards]}
        save_file(part, str(out / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, file)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def make_tiny_model(
    out_dir: str | Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    head_dim: int = 32,
    intermediate_size: int = 128,
    vocab_size: int = 1024,
    max_position_embeddings: int = 2048,
    seed: int = 0,
    arch: Literal["llama", "qwen2", "qwen3"] = "llama",
    rope_theta: float = 10000.0,
    rope_scaling: dict[str, Any] | None = None,
    tie_word_embeddings: bool | None = None,
    num_shards: int = 1,
    device: str = "cpu",
    dtype: str = "float32",
) -> Path:
    """Write the model folder to `out_dir` (created if needed) and return its path.

    `tie_word_embeddings` None: tied for Qwen, untied for Llama (the tiny test models
    then cover both paths)."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    if arch == "qwen2" and head_dim != hidden_size // num_heads:
        raise ValueError(
            "qwen2 derives head_dim as hidden_size // num_heads; pass a matching head_dim"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(vocab_size, seed)
    shape = dict(hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                 num_kv_heads=num_kv_heads, head_dim=head_dim, intermediate_size=intermediate_size,
                 max_position_embeddings=max_position_embeddings)  # fmt: skip
    # The embedding covers every tokenizer id; padded up to `vocab_size` like real models.
    model_vocab = max(vocab_size, tok.get_vocab_size())
    tied = arch != "llama" if tie_word_embeddings is None else tie_word_embeddings
    hf_cfg = _hf_config(arch, shape, tok, model_vocab, rope_theta, rope_scaling, tied, dtype)
    (out / "config.json").write_text(json.dumps(hf_cfg, indent=2))
    eos_ids = [tok.token_to_id(EOS), tok.token_to_id(IM_END)]
    gen_cfg = {"bos_token_id": tok.token_to_id(BOS), "eos_token_id": eos_ids, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2))
    tok.save(str(out / "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "model_max_length": max_position_embeddings,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    weights = _random_weights(ModelConfig.from_dict(hf_cfg), seed, device, parse_dtype(dtype))
    _save_weights(out, weights, num_shards)
    return out


def make_tiny_lora(model_dir: Path, out_dir: Path, rank: int = 8, seed: int = 1) -> Path:
    """A random LoRA adapter for the model in `model_dir`, in PEFT's format
    (`adapter_config.json`, `adapter_model.safetensors`): rank `rank` on every layer's
    q_proj and v_proj. Our engine serves no adapter; vLLM does (`--enable-lora
    --lora-modules NAME=out_dir`, tests/e2e/test_attach_vllm_events.py)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    hidden = cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    outs = {
        "q_proj": cfg["num_attention_heads"] * head_dim,
        "v_proj": cfg["num_key_value_heads"] * head_dim,
    }
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for module, out in outs.items():
            name = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, hidden, generator=gen) * 0.1
            tensors[f"{name}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * 0.1
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
        "lora_dropout": 0.0, "target_modules": list(outs), "bias": "none",
        "base_model_name_or_path": str(model_dir), "fan_in_fan_out": False,
        "inference_mode": True, "modules_to_save": None,
    }  # fmt: skip
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out_dir
