"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a slot-addressed KV pool.

Shapes: a forward pass runs the NEW tokens of every sequence in the batch,
concatenated into one flat `[T]` run, so each linear layer is one matmul for the
whole batch, decodes and prefill chunks alike. Attention writes the new K/V into the
pool at the new tokens' slots, then the attention backend (worker/engine/runtime/attention/)
reads each sequence's K/V (cached prefix + new) through the request->token table, so
a cached prefix is never recomputed.

Parameter names are Hugging Face's (`model.layers.0.self_attn.q_proj.weight`, ...),
so a checkpoint loads with `load_state_dict` and no renaming table; `fuse_projections`
then merges q/k/v and gate/up into one matmul each.

Numerics follow transformers exactly (RMSNorm in fp32 then cast back, RoPE tables
in fp32 then cast to the activation dtype), so fp32 logits match to ~1e-5. With the
triton backend, add+RMSNorm, RoPE+KV store and SiLU*mul are fused kernels
(fused_ops.py, `self.ops`) that round where these ops round: equal in fp32 to float
rounding, within one rounding step in bf16.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from worker.engine.model_config import ModelConfig
from worker.engine.runtime.attention.metadata import ForwardContext, KVStore
from worker.engine.runtime.fused_ops import TORCH_OPS, Ops, apply_rope_


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
    """The projections and o_proj around attention; DecoderLayer calls the backend
    between them (`project`, then `ctx.backend.attend`, then `o_proj`)."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        d, hd = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(d, self.num_heads * hd, bias=config.qkv_bias)
        self.k_proj = nn.Linear(d, self.num_kv_heads * hd, bias=config.qkv_bias)
        self.v_proj = nn.Linear(d, self.num_kv_heads * hd, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * hd, d, bias=config.o_bias)
        self.qkv_proj: nn.Linear | None = None  # set by fuse(): q, k, v in one matmul
        if config.qk_norm:  # Qwen3: RMSNorm over each head's q and k, before RoPE
            self.q_norm = RMSNorm(hd, config.rms_norm_eps)
            self.k_norm = RMSNorm(hd, config.rms_norm_eps)
        self.qk_norm = config.qk_norm

    def fuse(self) -> None:
        """One [q; k; v] projection instead of three (after the weights are loaded)."""
        self.qkv_proj = _concat_linears(self.q_proj, self.k_proj, self.v_proj)
        del self.q_proj, self.k_proj, self.v_proj

    def project(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: KVStore,
        slots: torch.Tensor,
        ops: Ops = TORCH_OPS,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, D], k and v [T, KV, D] after RoPE, with k and v stored at `slots`.

        Reads no step metadata but `slots`: the piecewise graphs (piecewise_graphs.py)
        capture this, and everything that varies per step must be a device tensor."""
        t = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_proj is not None and not self.qk_norm:
            qkv = self.qkv_proj(x)
            # q and k sit side by side in the merged output: one RoPE call for both,
            # and with the fused ops one kernel for RoPE and the K/V store.
            qk = qkv[:, : q_size + kv_size].view(t, heads + kv_heads, dim)
            v = qkv[:, q_size + kv_size :].view(t, kv_heads, dim)
            ops.rope_store(qk, v, cos, sin, kv, self.layer, slots, heads)
            return qk[:, :heads], qk[:, heads:], v
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k, v = q.view(t, heads, dim), k.view(t, kv_heads, dim), v.view(t, kv_heads, dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        apply_rope_(q, cos, sin)
        apply_rope_(k, cos, sin)
        kv.write(self.layer, slots, k, v)
        return q, k, v


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(d, i, bias=bias)
        self.up_proj = nn.Linear(d, i, bias=bias)
        self.down_proj = nn.Linear(i, d, bias=bias)
        self.gate_up_proj: nn.Linear | None = None  # set by fuse()

    def fuse(self) -> None:
        self.gate_up_proj = _concat_linears(self.gate_proj, self.up_proj)
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor, ops: Ops = TORCH_OPS) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(ops.silu_mul(gate, up))


def _concat_linears(*parts: nn.Linear) -> nn.Linear:
    w = parts[0].weight
    fused = nn.Linear(
        w.shape[1], sum(p.out_features for p in parts), bias=parts[0].bias is not None,
        device=w.device, dtype=w.dtype,
    )  # fmt: skip
    with torch.no_grad():
        fused.weight.copy_(torch.cat([p.weight for p in parts]))
        if fused.bias is not None:
            fused.bias.copy_(torch.cat([p.bias for p in parts]))
    return fused.requires_grad_(False)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx: ForwardContext,
        ops: Ops = TORCH_OPS,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v, residual = self.pre_attention(
            x, residual, cos, sin, ctx.kv, ctx.meta.out_slots, ops
        )
        out = ctx.backend.attend(self.self_attn.layer, q, k, v, ctx.meta)
        return self.post_attention(out, residual, ops)

    # The two halves around attention: the piecewise graphs capture them apart
    # (worker/engine/runtime/piecewise_graphs.py) and run attention eagerly between.
    def pre_attention(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: KVStore,
        slots: torch.Tensor,
        ops: Ops = TORCH_OPS,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q, k, v, residual): the input norm and the attention's projections."""
        norm = self.input_layernorm
        h, residual = ops.add_rmsnorm(x, residual, norm.weight, norm.eps)
        q, k, v = self.self_attn.project(h, cos, sin, kv, slots, ops)
        return q, k, v, residual

    def post_attention(
        self, out: torch.Tensor, residual: torch.Tensor, ops: Ops = TORCH_OPS
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) from the attention output [T, H, D]: o_proj, norm, MLP."""
        h = self.self_attn.o_proj(out.reshape(out.shape[0], -1))
        norm = self.post_attention_layernorm
        h, residual = ops.add_rmsnorm(h, residual, norm.weight, norm.eps)
        return self.mlp(h, ops), residual


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
        # The layers' elementwise ops: eager torch, or the fused triton kernels when
        # the runner picks the triton attention backend (fused_ops.py).
        self.ops: Ops = TORCH_OPS

    def fuse_projections(self, gate_up: bool = True) -> None:
        """Merge q/k/v (and gate/up) into one matmul each, after loading HF weights.

        Measured on CPU (bench preset, 1 thread, decode batch 1): q/k/v merged 26 vs
        34 us per layer; gate/up merged 171-206 vs 158-166 us per MLP (equal at batch
        8+), so the CPU keeps gate/up apart. On CUDA both are merged, as vLLM and
        SGLang do (one launch instead of two; not measured here)."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            if gate_up:
                layer.mlp.fuse()

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """Hidden states (before the last norm) of every new token: [T, hidden]."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope_tables(positions, x.dtype)
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, cos, sin, ctx, self.ops)
        return x + residual

    def rope_tables(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, head_dim / 2]: broadcast over heads; each half of a head
        uses them."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return freqs.cos().to(dtype)[:, None, :], freqs.sin().to(dtype)[:, None, :]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits for the given rows of `forward`'s output."""
        h = self.model.norm(hidden)
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(h, weight).float()
