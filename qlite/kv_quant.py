"""The quantized KV cache's records, pure functions: one record per (head, token) of head_dim values,
in groups of 32 with an fp16 scale each (the group's largest |value| / 127 or / 7), codes rounded to
nearest even. int8: codes [hd] then scales [hd / 32] (8.5 bits a value); int4: two codes per byte
[hd / 2], byte j of a group holding values j (low nibble) and j + 16, each + 8, then the scales
(4.5 bits a value). The native decode attention (csrc/attention.h) writes the same bytes and reads
them without decoding them to a tensor."""
from __future__ import annotations

import torch

GROUP = 32
KINDS = {"bf16": 16, "int8": 8, "int4": 4}  # --kv-cache: bf16 is the model's own 16-bit dtype


def record_bytes(bits: int, head_dim: int) -> int:
    return 2 * head_dim if bits == 16 else bits * head_dim // 8 + head_dim // 16


def encode(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Values (..., hd) -> records uint8 (..., record_bytes)."""
    qmax = 127 if bits == 8 else 7
    groups = x.float().unflatten(-1, (-1, GROUP))  # (..., hd / 32, 32)
    scale = (groups.abs().amax(-1, keepdim=True) / qmax).clamp(max=65504).half()  # (..., hd / 32, 1)
    s = scale.float()
    codes = torch.where(s > 0, groups / s, 0).round().clamp(-qmax, qmax).to(torch.int8)  # (..., hd / 32, 32)
    if bits == 8:
        body = codes.flatten(-2).view(torch.uint8)  # (..., hd)
    else:
        u = (codes + 8).to(torch.uint8)
        body = (u[..., :16] | (u[..., 16:] << 4)).flatten(-2)  # (..., hd / 2)
    return torch.cat([body, scale.squeeze(-1).contiguous().view(torch.uint8)], dim=-1)


def decode_heads(records: torch.Tensor, bits: int, head_dim: int, dtype: torch.dtype,
                 offset: torch.Tensor | None = None) -> torch.Tensor:
    """A cache's records (B, n_kv, T, record) -> values (B, n_kv, T, hd) in dtype, plus offset
    (float32 (n_kv, hd)) where given: natively for bf16 (native.kv_decode), else with decode."""
    if dtype == torch.bfloat16:
        from . import native
        values = native.kv_decode(records, bits, head_dim, offset)
        if values is not None:
            return values
    values = decode(records, bits, head_dim, torch.float32)
    return (values if offset is None else values + offset[:, None]).to(dtype)


def decode(records: torch.Tensor, bits: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Records uint8 (..., record_bytes) -> values (..., hd) in dtype."""
    body, scales = records.split([bits * head_dim // 8, head_dim // 16], dim=-1)
    scale = scales.contiguous().view(torch.float16).float()[..., None]  # (..., hd / 32, 1)
    if bits == 8:
        codes = body.contiguous().view(torch.int8).unflatten(-1, (-1, GROUP))  # (..., hd / 32, 32)
    else:
        nibbles = body.unflatten(-1, (-1, GROUP // 2))  # (..., hd / 32, 16)
        codes = torch.cat([nibbles & 15, nibbles >> 4], dim=-1).to(torch.int8) - 8  # (..., hd / 32, 32)
    return (codes.float() * scale).flatten(-2).to(dtype)
