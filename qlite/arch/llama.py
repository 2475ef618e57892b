"""Llama (2, 3, 3.1+): no bias unless the config's attention_bias, rope theta 10000 by default, Llama 3.1's
rope scaling ("llama3"), and llama.cpp's converter storing q/k rows reordered (each head's two rotation
halves interleaved, for its own rotation layout)."""
from __future__ import annotations

import math

import torch

from ..errors import QliteError
from .base import Architecture

# Llama 3's pre-tokenizer split: digits in runs of up to three
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


class Llama(Architecture):
    model_type, hf_class, gguf_arch = "llama", "LlamaForCausalLM", "llama"
    gguf_split, gguf_pre, gguf_bos = LLAMA3_SPLIT, "llama-bpe", 128000

    def rope_scaling(self, scaling, source):
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind in (None, "default"):
            return None
        if kind != "llama3":
            return super().rope_scaling(scaling, source)
        values = {}
        for name in LLAMA3_FIELDS:
            v = scaling.get(name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise QliteError(f"{source}: rope scaling llama3 needs a positive {name}, got {v!r}")
            values[name] = v
        if values["high_freq_factor"] <= values["low_freq_factor"]:
            raise QliteError(f"{source}: rope scaling llama3: high_freq_factor must exceed low_freq_factor")
        return tuple(sorted({"rope_type": "llama3", **values}.items()))

    def inv_freq(self, cfg):
        inv_freq = super().inv_freq(cfg)
        if cfg.rope_scaling is None:
            return inv_freq
        s = dict(cfg.rope_scaling)  # transformers' _compute_llama3_parameters
        factor, low, high, original = (s[name] for name in LLAMA3_FIELDS)
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)  # long wavelengths: / factor
        smooth = (original / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < original / high) & ~(wavelen > original / low)
        return torch.where(medium, blended, scaled)

    def gguf_rows(self, name, rows, n_head, n_kv):
        heads = n_head if ".q_proj." in name else n_kv if ".k_proj." in name else None
        if heads is None:
            return None
        # (heads, 2, half) -> (heads, half, 2): each head's halves interleaved
        return torch.arange(rows).reshape(heads, 2, rows // heads // 2).transpose(1, 2).reshape(-1)
