"""One decoder layer and its parts: x + attn(norm(x)), then x + mlp(norm(x)), the MLP dense (SwiGLU) or,
in a mixture of experts' sparse layers, SparseMLP (mlp.py). What a model type changes (q/k/v bias, per-head q/k
norms, scaled rotary frequencies, experts) its Architecture (arch/) and config say."""
from __future__ import annotations

import torch
from torch import nn

from ..arch.rope import dynamic_inv_freq
from ..config import ModelConfig
from .linear import SplitLinear, make_linear
from .mlp import MLP, SparseMLP
from .ops import Step, TorchOps

class RMSNorm(nn.Module):
    ops = TorchOps

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rmsnorm(x, self.weight, self.eps)


class Rotary(nn.Module):
    """cos/sin of the rotary angles for given positions, in float32 (frequencies: the architecture's)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        inv_freq, self.attention_factor = cfg.arch.rope(cfg)  # the factor on cos and sin (YaRN's; else 1)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        scaling = dict(cfg.rope_scaling or ())
        self.dynamic = (scaling, cfg.head_dim, cfg.rope_theta) if scaling.get("rope_type") == "dynamic" else None

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq
        if self.dynamic is not None:  # frequencies from each row's length so far (its last position + 1)
            inv_freq = dynamic_inv_freq(*self.dynamic, positions.amax(-1) + 1)[:, None]  # (B, 1, head_dim/2)
        freqs = positions[..., None].float() * inv_freq  # (B, T, head_dim/2)
        angles = torch.cat([freqs, freqs], dim=-1)[:, None]  # (B, 1, T, head_dim)
        if self.attention_factor == 1.0:
            return angles.cos(), angles.sin()
        return angles.cos() * self.attention_factor, angles.sin() * self.attention_factor


class Attention(nn.Module):
    ops = TorchOps

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        prefix = f"model.layers.{layer_idx}.self_attn."
        q_rows, kv_rows = self.n_head * self.head_dim, self.n_kv * self.head_dim
        self.qkv_proj = make_linear(cfg, prefix, cfg.hidden_size, {"q_proj": q_rows, "k_proj": kv_rows,
                                                                   "v_proj": kv_rows}, bias=cfg.attention_bias)
        self.o_proj = make_linear(cfg, prefix, q_rows, {"o_proj": cfg.hidden_size}, bias=cfg.output_bias)
        if cfg.arch.qk_norm:
            self.q_norm, self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps), RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        if hasattr(self, "q_norm"):
            qkv = self.normed_heads(qkv)
        return self.o_proj(self.ops.attention(qkv, step, self))

    def key_bias(self) -> torch.Tensor | None:
        """k_proj's bias (n_kv * head_dim,), or None."""
        qkv = self.qkv_proj
        if isinstance(qkv, SplitLinear):
            return qkv["k_proj"].bias
        rows = self.n_head * self.head_dim
        return None if qkv.bias is None else qkv.bias[rows:rows + self.n_kv * self.head_dim]

    def normed_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        """q and k of qkv (B, T, q|k|v) each RMS-normed per head (Qwen3), v as it is."""
        B, T, _ = qkv.shape
        q, k, v = qkv.split([self.n_head * self.head_dim, self.n_kv * self.head_dim, self.n_kv * self.head_dim], dim=-1)
        q = self.q_norm(q.reshape(B, T, self.n_head, self.head_dim)).reshape(B, T, -1)  # per head
        k = self.k_norm(k.reshape(B, T, self.n_kv, self.head_dim)).reshape(B, T, -1)
        return torch.cat([q, k, v], dim=-1)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        prefix = f"model.layers.{layer_idx}.mlp."
        if cfg.experts is not None and cfg.experts.sparse(layer_idx):
            self.mlp = SparseMLP(cfg, prefix)
        else:
            self.mlp = MLP(cfg, prefix, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), step)
        return x + self.mlp(self.post_attention_layernorm(x))
