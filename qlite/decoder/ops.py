"""What every layer of one forward shares (`Step`) and the reference small ops of a forward (`TorchOps`:
RMSNorm, SiLU * up, rotary attention over the cache), in torch; backends.py may install faster ones.
References: HF transformers' modeling_qwen2 (RMSNorm in float32, grouped-query attention, rotary
embeddings in the half-rotation (NeoX) layout)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

@dataclass
class Step:
    """What every layer of one forward shares: rotary cos/sin (float32, (B, 1, T, head_dim)), the KV
    cache (None: no cache), the attention mask (None: plain causal), where the new tokens start, and
    for a padded batch whose rows' tokens are each one run to the end, where each row's keys start
    (`key_starts`); padded: whether rows are padded at all (else the mask is plain causal from `start`).
    one_at_a_time: several new tokens of one sequence whose every number must be what one-token steps give
    (CausalLM.forward's `exact`): the fused decode layers may take them (fused.py)."""
    cos: torch.Tensor
    sin: torch.Tensor
    cache: "KVCache | None"
    mask: torch.Tensor | None
    start: int
    key_starts: torch.Tensor | None = None
    one_at_a_time: bool = False
    padded: bool = False


class TorchOps:
    """The reference small ops of a forward, in torch."""
    name = "torch"

    @staticmethod
    def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(x.dtype)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def attention(qkv: torch.Tensor, step: Step, attn: "Attention") -> torch.Tensor:
        """Rotary q and k, the cache updated, attention: (B, T, q|k|v) -> (B, T, n_head * head_dim)."""
        B, T, _ = qkv.shape
        n_head, n_kv, hd = attn.n_head, attn.n_kv, attn.head_dim
        q, k, v = qkv.split([n_head * hd, n_kv * hd, n_kv * hd], dim=-1)
        q = q.view(B, T, n_head, hd).transpose(1, 2)  # (B, n_head, T, head_dim)
        k = k.view(B, T, n_kv, hd).transpose(1, 2)  # (B, n_kv, T, head_dim)
        v = v.view(B, T, n_kv, hd).transpose(1, 2)  # (B, n_kv, T, head_dim)
        cos, sin = step.cos.to(q.dtype), step.sin.to(q.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if step.cache is not None:
            k, v = step.cache.update(attn.layer_idx, k, v, step.start)  # (B, n_kv, start + T, head_dim)
        if step.key_starts is not None and T > 1:
            y = TorchOps.rows_alone(q, k, v, step)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=step.mask, is_causal=step.mask is None and T > 1,
                                               enable_gqa=n_kv != n_head)
        return y.transpose(1, 2).reshape(B, T, n_head * hd)  # (B, T, hidden)

    @staticmethod
    def rows_alone(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step) -> torch.Tensor:
        """Attention of a left-padded batch's new tokens (q (B, n_head, T, hd), k and v (B, n_kv, S, hd)), each
        row over its own keys only, as the row's prompt alone computes it: the attention of one padded call
        sums over the padding's keys too (weights 0, but another order of sums), so a prompt prefilled in a
        batch got other bits than alone. The padding's own queries get zeros."""
        T = q.shape[2]
        y = q.new_zeros(q.shape)
        for r, first_key in enumerate(step.key_starts.tolist()):
            first = max(first_key - step.start, 0)  # the row's first real query in this chunk
            if first >= T:
                continue
            mask = attention_mask(T - first, step.start + first - first_key, None, q.device)  # None: plain causal
            y[r:r + 1, :, first:] = F.scaled_dot_product_attention(
                q[r:r + 1, :, first:], k[r:r + 1, :, first_key:], v[r:r + 1, :, first_key:], attn_mask=mask,
                is_causal=mask is None and T - first > 1, enable_gqa=k.shape[1] != q.shape[1])
        return y

    @staticmethod
    def sparse_mlp(mlp, x: torch.Tensor) -> torch.Tensor:
        """A mixture of experts' sparse MLP (decoder/mlp.py) of x (B, T, hidden): each token's k experts, each
        expert once over the tokens that chose it, experts ascending (each token's sum in transformers' order),
        weighted by the router; plus the shared expert's output under its sigmoid gate."""
        B, T, H = x.shape
        flat = x.reshape(B * T, H)  # (N, hidden)
        chosen, weights = mlp.route(flat)
        out = torch.zeros_like(flat)
        for expert, tokens, pairs in mlp.groups(chosen):
            out.index_add_(0, tokens, mlp.experts[expert](flat[tokens]) * weights.reshape(-1)[pairs, None])
        if hasattr(mlp, "shared_expert"):
            out = out + torch.sigmoid(mlp.shared_expert_gate(flat)) * mlp.shared_expert(flat)
        return out.view(B, T, H)

    @staticmethod
    def argmax_rows(logits: torch.Tensor) -> tuple[list[int], list[bool]]:
        """Per row of logits (B, V): the index of the largest, and whether all are finite."""
        rows = logits.float()
        return rows.argmax(-1).tolist(), torch.isfinite(rows).all(-1).tolist()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin




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


def key_starts(key_mask: torch.Tensor) -> torch.Tensor | None:
    """(B,) where each row's real tokens start, when in every row they are one run up to the last
    column (left padding, as generate and the server keep them); None otherwise."""
    S = key_mask.shape[1]
    starts = S - key_mask.sum(-1)  # (B,)
    run = torch.arange(S, device=key_mask.device)[None, :] >= starts[:, None]  # (B, S)
    return starts if bool((run == key_mask).all()) else None
