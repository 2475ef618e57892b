"""The Qwen2 decoder: embedding -> N x [x + attn(norm(x)); x + mlp(norm(x))] -> norm -> lm_head.

References: the Qwen2 architecture (Qwen2 technical report; HF transformers' modeling_qwen2, which the
tests use as the reference): RMSNorm computed in float32, grouped-query attention with q/k/v bias,
rotary embeddings in the half-rotation (NeoX) layout, SwiGLU MLP. Parameter names follow the HF
checkpoints, so a state dict loads without renaming.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import native
from .config import Qwen2Config


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype == torch.bfloat16 and native.bf16_ready(x):
            return native.rmsnorm(x, self.weight, self.eps)  # the same computation, one call
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Rotary(nn.Module):
    """cos/sin of the rotary angles for given positions, computed in float32."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device="cpu").float() / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq  # (B, T, head_dim/2)
        angles = torch.cat([freqs, freqs], dim=-1)[:, None]  # (B, 1, T, head_dim)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class KVCache:
    """Keys and values of every layer, preallocated: (layers, B, n_kv_heads, capacity, head_dim)."""

    def __init__(self, cfg: Qwen2Config, batch: int, capacity: int, dtype: torch.dtype, device="cpu"):
        shape = (cfg.num_hidden_layers, batch, cfg.num_key_value_heads, capacity, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity
        self.length = 0

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


class Attention(nn.Module):
    def __init__(self, cfg: Qwen2Config):
        super().__init__()
        self.n_head, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_head * self.head_dim, bias=True)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=True)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=True)
        self.o_proj = nn.Linear(self.n_head * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, cache_kv, start: int, mask, native_decode: bool = False):
        B, T, _ = x.shape
        if native_decode:  # one token, one sequence: rotary, cache update and attention in one call
            y = native.decode_attention(self.qkv_proj(x), cos, sin, cache_kv[0][0], cache_kv[1][0], self.n_head, start)
            return self.o_proj(y.view(B, T, -1))
        if hasattr(self, "qkv_proj"):  # fused at load (fuse.py): one matmul instead of three
            q, k, v = self.qkv_proj(x).split([self.n_head * self.head_dim, self.n_kv * self.head_dim,
                                              self.n_kv * self.head_dim], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, n_head, T, head_dim)
        k = k.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)  # (B, n_kv, T, head_dim)
        v = v.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)  # (B, n_kv, T, head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache_kv is not None:
            cache_k, cache_v = cache_kv
            cache_k[:, :, start:start + T] = k
            cache_v[:, :, start:start + T] = v
            k, v = cache_k[:, :, :start + T], cache_v[:, :, :start + T]  # (B, n_kv, S, head_dim)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and T > 1,
                                           enable_gqa=self.n_kv != self.n_head)
        y = y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim)  # (B, T, hidden)
        return self.o_proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: Qwen2Config):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        if hasattr(self, "gate_up_proj"):  # fused at load (fuse.py)
            gate_up = self.gate_up_proj(x)
            if native.bf16_ready(gate_up):
                return self.down_proj(native.silu_mul(gate_up))
            gate, up = gate_up.chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen2Config):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, cache_kv, start, mask, native_decode=False):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache_kv, start, mask, native_decode)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2Model(nn.Module):
    def __init__(self, cfg: Qwen2Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)


def attention_mask(T: int, start: int, key_mask: torch.Tensor | None, device) -> torch.Tensor | None:
    """Boolean mask (B or 1, 1, T, start+T), True where a query may attend; None when plain causal
    attention (prefill from 0) or full attention (one new token) is exact."""
    if key_mask is None and (start == 0 or T == 1):
        return None
    S = start + T
    q_pos = torch.arange(start, S, device=device)[:, None]  # (T, 1)
    k_pos = torch.arange(S, device=device)[None, :]  # (1, S)
    allowed = (k_pos <= q_pos)[None]  # (1, T, S)
    if key_mask is not None:
        # A padding query still sees itself, so no row is fully masked (that would give NaN).
        allowed = (allowed & key_mask[:, None, :S]) | (k_pos == q_pos)  # (B, T, S)
    return allowed[:, None]  # (B, 1, T, S)


class Qwen2ForCausalLM(nn.Module):
    def __init__(self, cfg: Qwen2Config):
        super().__init__()
        self.config = cfg
        self.model = Qwen2Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings and isinstance(self.lm_head, nn.Linear):
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def fused_attention(self) -> bool:
        return all(hasattr(layer.self_attn, "qkv_proj") for layer in self.model.layers)

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        return KVCache(self.config, batch, capacity, self.dtype, self.device)

    def forward(self, input_ids: torch.Tensor, cache: KVCache | None = None, positions: torch.Tensor | None = None,
                key_mask: torch.Tensor | None = None, last_only: bool = False) -> torch.Tensor:
        """Logits (B, T or 1, vocab) for input_ids (B, T), appended to `cache` if given.
        key_mask (B, cache.length + T), True for real tokens, is needed only for padded batches;
        positions (B, T) default to cache.length + 0..T-1."""
        B, T = input_ids.shape
        start = cache.length if cache is not None else 0
        if cache is not None and start + T > cache.capacity:
            raise ValueError(f"KV cache holds {cache.capacity} tokens, {start + T} asked")
        if positions is None:
            positions = torch.arange(start, start + T, device=input_ids.device).expand(B, T)
        mask = attention_mask(T, start, key_mask, input_ids.device)
        x = self.model.embed_tokens(input_ids)  # (B, T, hidden)
        native_decode = (B == 1 and T == 1 and mask is None and cache is not None and self.fused_attention
                         and native.bf16_ready(cache.k))
        cos, sin = self.model.rotary(positions, torch.float32 if native_decode else x.dtype)
        for i, layer in enumerate(self.model.layers):
            cache_kv = (cache.k[i], cache.v[i]) if cache is not None else None
            x = layer(x, cos, sin, cache_kv, start, mask, native_decode)
        if cache is not None:
            cache.length += T
        if last_only:
            x = x[:, -1:]
        return self.lm_head(self.model.norm(x))
