"""Will it fit: the memory a run needs, from a checkpoint's config and tensor headers, before anything
is loaded; the longest context that fits in what this machine has; the one-line refusal generate,
chat and serve give up front instead of dying of OOM halfway.

The parts (all resident at once at the peak, which is the last prefill chunk of a full context):
  runtime      Python, torch, qlite and the tokenizer (RUNTIME_BYTES, measured: eval/benchmarks/fit_check.py)
  weights      every tensor the run reads whole, floating ones at the run's dtype (mapped from the file
               where they are stored so); a model with its own lm_head reads only the looked-up rows of
               its embedding table, which is left out
  kv cache     2 x layers x batch x kv heads x tokens x a token's record (bf16, or kv_quant's int8 / int4)
  activations  one prefill chunk's hidden states, attention and MLP outputs, rotary tables, last logits
  scratch      the larger of: a quantized gate|up or down dequantized to bf16 for a prefill matmul (not int4
               ones where the integer-activation product runs them), and the file
               pages of the largest tensor converted at load (stored in another dtype than the run's)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import QliteError

RUNTIME_BYTES = 320 * 2**20  # python + torch + qlite + a Qwen tokenizer: 304-327 MiB in generate runs (BENCHMARKS.md)
PREFILL_CHUNK = 512  # CausalLM.prefill_chunk (tests check they agree)


@dataclass(frozen=True)
class MemoryNeed:
    runtime: int
    weights: int
    kv_cache: int
    activations: int
    scratch: int

    @property
    def total(self) -> int:
        return self.runtime + self.weights + self.kv_cache + self.activations + self.scratch

    def describe(self) -> str:
        parts = ", ".join(f"{name.replace('_', ' ')} {size_text(getattr(self, name))}"
                          for name in ("weights", "kv_cache", "activations", "scratch", "runtime"))
        return f"{size_text(self.total)} ({parts})"


def size_text(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


FLOAT_NAMES = {2: ("F16", "BF16"), 4: ("F32",)}  # the safetensors dtypes a run of that width may map as stored


def floating(name: str, t) -> bool:
    """A parameter the run casts to its dtype (codes and scales keep theirs)."""
    return t.dtype in ("F16", "BF16", "F32", "F64") and name.endswith((".weight", ".bias"))


def weight_bytes(ckpt, dtype_bytes: int, resident: bool = False) -> int:
    """Every tensor: floating weights and biases at the run's dtype, the rest (codes, scales) as stored.
    resident: without the embedding table of a model that has its own lm_head (only looked-up rows
    of it are read)."""
    own_head = any(name.startswith("lm_head.") for name in ckpt.tensors)
    total = 0
    for name, t in ckpt.tensors.items():
        if resident and own_head and name.startswith("model.embed_tokens."):
            continue
        total += math.prod(t.shape) * dtype_bytes if floating(name, t) else t.nbytes
    return total


def load_transient_bytes(ckpt, run_dtype: str) -> int:
    """The file pages of the largest tensor converted at load (a float tensor stored in another dtype
    than the run's: its pages and its converted copy are both resident while it converts)."""
    return max((t.nbytes for name, t in ckpt.tensors.items() if floating(name, t) and t.dtype != run_dtype), default=0)


def kv_cache_bytes(cfg, tokens: int, batch: int, kv_bits: int, dtype_bytes: int) -> int:
    from .kv_quant import record_bytes
    record = cfg.head_dim * dtype_bytes if kv_bits == 16 else record_bytes(kv_bits, cfg.head_dim)
    return 2 * cfg.num_hidden_layers * batch * cfg.num_key_value_heads * tokens * record


def activation_bytes(cfg, tokens: int, batch: int, dtype_bytes: int) -> int:
    """One forward of a prefill chunk (the residual, normed copy and float32 norm temporaries, q|k|v,
    attention's output, gate|up, the product, the MLP's output), the whole prompt's rotary tables
    (float32 cos/sin and their temporaries) and the last position's logits (bf16 and float32)."""
    T = min(tokens, PREFILL_CHUNK) * batch
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    per_token = dtype_bytes * (4 * cfg.hidden_size + qkv + cfg.num_attention_heads * cfg.head_dim
                               + 3 * cfg.token_mlp_width) + 4 * 2 * cfg.hidden_size
    rotary = 4 * 4 * batch * tokens * cfg.head_dim
    return T * per_token + rotary + batch * cfg.vocab_size * (dtype_bytes + 4)


def scratch_bytes(cfg) -> int:
    """The largest quantized MLP linear a prefill dequantizes to bf16 (gate|up: 2 x width x hidden; down:
    half that; a dense MLP's or an expert's). 0 for a 16-bit checkpoint."""
    from .kernels import dequantized_for_prefill
    if cfg.quantization is None:
        return 0
    most = 0
    for i in range(cfg.num_hidden_layers):
        for prefix, width in cfg.mlp_modules(i):
            for name, rows, k in (("gate_proj", 2 * width, cfg.hidden_size), ("down_proj", cfg.hidden_size, width)):
                fmt = cfg.quantization.format_for(prefix + name)
                if fmt is not None and dequantized_for_prefill(fmt, k):
                    most = max(most, 2 * rows * k)
    return most


def need(ckpt, tokens: int, batch: int = 1, kv_bits: int = 16, dtype=None) -> MemoryNeed:
    """What a run of `batch` sequences of `tokens` tokens (prompt and reply) holds at its peak, in the
    float dtype `dtype` (a torch dtype; default bf16)."""
    import torch

    from .checkpoint import DTYPE_NAMES

    dtype = dtype or torch.bfloat16
    cfg, size = ckpt.config, dtype.itemsize
    return MemoryNeed(RUNTIME_BYTES, weight_bytes(ckpt, size, resident=True), kv_cache_bytes(cfg, tokens, batch, kv_bits, size),
                      activation_bytes(cfg, tokens, batch, size),
                      max(scratch_bytes(cfg), load_transient_bytes(ckpt, DTYPE_NAMES[dtype])))


def available_here() -> int | None:
    """Memory this process may use: what the machine can give without swapping plus what it holds now."""
    from .memory import available_bytes, rss_bytes
    free = available_bytes()
    return None if free is None else free + rss_bytes()


def longest_context(ckpt, available: int, batch: int = 1, kv_bits: int = 16, dtype=None) -> int:
    """The most tokens per sequence (up to the model's context) whose run fits in `available`; 0: none."""
    lo, hi = 0, ckpt.config.context_length
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if need(ckpt, mid, batch, kv_bits, dtype).total <= available:
            lo = mid
        else:
            hi = mid - 1
    return lo


def fitting_context(model_dir, model) -> int:
    """The loaded model's context, or the longest part of it that fits here (at least 2 tokens)."""
    from .checkpoint import CheckpointDir

    available = available_here()
    context = model.config.context_length
    if available is None:
        return context
    return max(2, longest_context(CheckpointDir(model_dir), available, 1, model.kv_bits, model.dtype))


def check_fits(model_dir, model, tokens: int, flag: str, batch: int = 1, available: int | None = None) -> None:
    """A one-line QliteError, naming `flag`, when a run of the loaded model (its dtype, its KV cache
    kind) over `batch` x `tokens` cannot fit in this machine's memory."""
    from .checkpoint import CheckpointDir

    available = available_here() if available is None else available
    if available is None:
        return
    ckpt = CheckpointDir(model_dir)
    needed = need(ckpt, tokens, batch, model.kv_bits, model.dtype)
    if needed.total <= available:
        return
    longest = longest_context(ckpt, available, batch, model.kv_bits, model.dtype)
    rows = f"{batch} x " if batch > 1 else ""
    hint = "" if model.kv_bits == 4 else " or a smaller --kv-cache"
    raise QliteError(f"{flag}: {rows}{tokens} tokens need {needed.describe()}, this machine has {size_text(available)}; "
                     f"the longest context that fits is {longest} tokens (give a shorter one{hint})")
