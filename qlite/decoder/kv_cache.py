"""The KV cache's storage: every layer's keys and values, 16-bit or kv_quant's int8 / int4 records."""
from __future__ import annotations

import torch

from .. import kv_quant
from ..config import ModelConfig

class KVCache:
    """Keys and values of every layer: (layers, B, n_kv_heads, capacity, record), a record being a
    token's head_dim values in the model's dtype (bits 16) or kv_quant's int8 / int4 records (uint8
    bytes). It starts at `capacity` tokens and grows (doubling, copied) as tokens arrive, up to `limit`:
    memory follows what a generation uses, not what it might."""

    def __init__(self, cfg: ModelConfig, batch: int, capacity: int, dtype: torch.dtype, device="cpu",
                 limit: int | None = None, kv_bits: int = 16, k_offset: torch.Tensor | None = None):
        # k_offset: float32 (layers, n_kv, head_dim) taken off the keys a quantized cache stores (CausalLM.key_offsets)
        self.kv_bits, self.dtype, self.head_dim, self.k_offset = kv_bits, dtype, cfg.head_dim, k_offset
        record = cfg.head_dim if kv_bits == 16 else kv_quant.record_bytes(kv_bits, cfg.head_dim)
        shape = (cfg.num_hidden_layers, batch, cfg.num_key_value_heads, capacity, record)
        self.k = torch.zeros(shape, dtype=dtype if kv_bits == 16 else torch.uint8, device=device)
        self.v = torch.zeros_like(self.k)
        self.limit = max(capacity, limit or capacity)
        self.length = 0  # tokens stored; a forward's layers write at length.., then it advances

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    def reserve(self, tokens: int) -> None:
        """Room for `tokens` in all: grow if needed, up to the limit."""
        if tokens <= self.capacity:
            return
        if tokens > self.limit:
            raise ValueError(f"KV cache holds at most {self.limit} tokens, {tokens} asked")
        grown = min(self.limit, max(tokens, 2 * self.capacity))
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_zeros((*old.shape[:3], grown, old.shape[4]))
            new[:, :, :, :self.length] = old[:, :, :, :self.length]
            setattr(self, name, new)
            del old

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, n_kv, T, head_dim) at start..start+T (the forward's new tokens: start is where
        it began, or one token of it); return the keys and values up to there (B, n_kv, start + T, hd),
        as stored (a quantized cache's decoded)."""
        end = start + k.shape[2]
        if self.kv_bits == 16:
            self.k[layer][:, :, start:end] = k
            self.v[layer][:, :, start:end] = v
            return self.k[layer][:, :, :end], self.v[layer][:, :, :end]
        offset = None if self.k_offset is None else self.k_offset[layer]  # (n_kv, head_dim)
        self.k[layer][:, :, start:end] = kv_quant.encode(k.float() - (0 if offset is None else offset[:, None]),
                                                         self.kv_bits)
        self.v[layer][:, :, start:end] = kv_quant.encode(v, self.kv_bits)
        return (kv_quant.decode_heads(self.k[layer][:, :, :end], self.kv_bits, self.head_dim, k.dtype, offset),
                kv_quant.decode_heads(self.v[layer][:, :, :end], self.kv_bits, self.head_dim, v.dtype))

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def first_rows(self, n: int) -> "KVCache":
        """A cache over rows 0..n-1 of this one, sharing its storage and length (no growth)."""
        view = object.__new__(KVCache)
        view.__dict__.update(self.__dict__)
        view.k, view.v, view.limit = self.k[:, :n], self.v[:, :n], self.capacity
        return view
