"""The Llama-family decoder (Llama, Mistral, Qwen2) over a slot-addressed KV pool.

Shapes: a forward pass runs the NEW tokens of every sequence in the batch,
concatenated into one flat `[T]` run, so each linear layer is one matmul for the
whole batch. Only attention is per sequence: it writes the new K/V into the pool at
the new tokens' slots, then gathers the sequence's whole K/V (cached prefix + new)
through its slot list, so a cached prefix is never recomputed.

Parameter names are Hugging Face's (`model.layers.0.self_attn.q_proj.weight`, ...),
so a checkpoint loads with `load_state_dict` and no renaming table.

Numerics follow transformers exactly (RMSNorm in fp32 then cast back, RoPE tables
in fp32 then cast to the activation dtype), so fp32 logits match to ~1e-5.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from worker.engine.model_config import ModelConfig


class KVStore(Protocol):
    """What attention needs from the KV pool (worker/engine/kv_pool.py)."""

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True)
class SeqSpan:
    """One sequence's share of a flat batch: query rows [q_start, q_end) of the batch,
    `kv_slots` the slots of all its tokens (prefix + new), and the causal mask for
    its new tokens (None when no mask is needed: a single decode token, or a prefill
    with no prefix, which uses `is_causal`)."""

    q_start: int
    q_end: int
    start_pos: int
    kv_slots: torch.Tensor
    mask: torch.Tensor | None


@dataclass(frozen=True)
class DecodeGroup:
    """Single-token (decode) sequences attended in ONE padded SDPA call instead of a
    loop: `rows` are their query rows in the batch, `slots` [B, L] their KV slots
    padded to the longest, `mask` [B, 1, 1, L] False on the padding."""

    rows: torch.Tensor
    slots: torch.Tensor
    mask: torch.Tensor


@dataclass(frozen=True)
class ForwardContext:
    """Built once per forward by the runner and shared by every layer."""

    kv: KVStore
    new_slots: torch.Tensor  # [T] slot of each new token, in batch order
    seqs: tuple[SeqSpan, ...]  # attended one by one (prefills, chunks, a lone decode)
    decode: DecodeGroup | None = None


def prefix_causal_mask(start_pos: int, n_new: int, device: torch.device) -> torch.Tensor | None:
    """New token i sees every prefix token and new tokens <= i: True = attend."""
    if n_new == 1 or start_pos == 0:
        return None
    full = torch.ones(n_new, start_pos + n_new, dtype=torch.bool, device=device)
    return full.tril(diagonal=start_pos)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies (fp32, CPU) with `linear` or Llama-3 scaling applied."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # Llama 3.1: leave high frequencies alone, divide low ones by `factor`, and blend
    # smoothly in between (transformers' _compute_llama3_parameters).
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.kv_groups = self.num_heads // self.num_kv_heads
        d, hd = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(d, self.num_heads * hd, bias=config.qkv_bias)
        self.k_proj = nn.Linear(d, self.num_kv_heads * hd, bias=config.qkv_bias)
        self.v_proj = nn.Linear(d, self.num_kv_heads * hd, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * hd, d, bias=config.o_bias)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        ctx.kv.write(self.layer, ctx.new_slots, k, v)
        out = torch.empty_like(q)
        for seq in ctx.seqs:
            if seq.start_pos == 0:
                # Nothing cached: the K/V just computed are the whole sequence.
                k_seq, v_seq = k[seq.q_start : seq.q_end], v[seq.q_start : seq.q_end]
            else:
                k_seq, v_seq = ctx.kv.read(self.layer, seq.kv_slots)
            k_seq, v_seq, gqa = self._kv_heads(k_seq, v_seq, head_dim=1)
            # [n, heads, dim] -> [1, heads, n, dim] for SDPA.
            o = F.scaled_dot_product_attention(
                q[seq.q_start : seq.q_end].transpose(0, 1).unsqueeze(0),
                k_seq.transpose(0, 1).unsqueeze(0),
                v_seq.transpose(0, 1).unsqueeze(0),
                attn_mask=seq.mask,
                is_causal=seq.start_pos == 0 and seq.q_end - seq.q_start > 1,
                enable_gqa=gqa,
            )
            out[seq.q_start : seq.q_end] = o.squeeze(0).transpose(0, 1)
        if ctx.decode is not None:
            out[ctx.decode.rows] = self._decode_attention(q, ctx.decode, ctx.kv)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))

    def _decode_attention(self, q: torch.Tensor, group: DecodeGroup, kv: KVStore) -> torch.Tensor:
        b, length = group.slots.shape
        k, v = kv.read(self.layer, group.slots.flatten())
        # [B*L, kv_heads, dim] -> [B, kv_heads, L, dim]; queries [B, heads, 1, dim].
        k = k.view(b, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        k, v, gqa = self._kv_heads(k, v, head_dim=1)
        o = F.scaled_dot_product_attention(
            q[group.rows].unsqueeze(2), k, v, attn_mask=group.mask, enable_gqa=gqa
        )
        return o.squeeze(2)

    def _kv_heads(
        self, k: torch.Tensor, v: torch.Tensor, head_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """K/V ready for SDPA, and whether SDPA must broadcast KV heads itself (GQA).

        CUDA kernels handle GQA natively. On CPU, SDPA's `enable_gqa` path is about 100x
        slower than repeating the KV heads first (8.4 ms vs 0.07 ms for one decode query
        over 40 keys, measured here), so CPU repeats them.
        """
        if self.kv_groups == 1:
            return k, v, False
        if k.device.type != "cpu":
            return k, v, True
        return (
            k.repeat_interleave(self.kv_groups, dim=head_dim),
            v.repeat_interleave(self.kv_groups, dim=head_dim),
            False,
        )


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(d, i, bias=bias)
        self.up_proj = nn.Linear(d, i, bias=bias)
        self.down_proj = nn.Linear(i, d, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """`model.*` + `lm_head` (absent when tied to the input embeddings)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        # Not a checkpoint tensor: derived from the config, kept in fp32 like transformers.
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """Final hidden states (before the last norm) of every new token: [T, hidden]."""
        x = self.model.embed_tokens(input_ids)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        # [T, 1, head_dim]: broadcasts over heads.
        cos, sin = emb.cos().to(x.dtype)[:, None, :], emb.sin().to(x.dtype)[:, None, :]
        for layer in self.model.layers:
            x = layer(x, cos, sin, ctx)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits for the given rows of `forward`'s output."""
        h = self.model.norm(hidden)
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(h, weight).float()
