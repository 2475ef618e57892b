"""Llama (2, 3, 3.1+): no bias unless the config's attention_bias, rope theta 10000 by default, Llama 3.1's
rope scaling ("llama3"), and llama.cpp's converter storing q/k rows reordered (each head's two rotation
halves interleaved, for its own rotation layout)."""
from __future__ import annotations

import torch

from .base import Architecture
from .config_fields import Ignored

# Llama 3's pre-tokenizer split: digits in runs of up to three
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


class Llama(Architecture):
    model_type, hf_class, gguf_arch = "llama", "LlamaForCausalLM", "llama"
    gguf_split, gguf_pre, gguf_bos = LLAMA3_SPLIT, "llama-bpe", 128000
    rope_scalings = ("llama3", "linear", "yarn", "dynamic")
    config_fields = {"pretraining_tp": Ignored("tensor-parallel slices of the same products in training; "
                                               "transformers 5 no longer reads it")}

    def gguf_rows(self, name, rows, n_head, n_kv):
        heads = n_head if ".q_proj." in name else n_kv if ".k_proj." in name else None
        if heads is None:
            return None
        # (heads, 2, half) -> (heads, half, 2): each head's halves interleaved
        return torch.arange(rows).reshape(heads, 2, rows // heads // 2).transpose(1, 2).reshape(-1)
