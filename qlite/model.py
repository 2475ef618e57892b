"""The decoder: embedding -> N x [x + attn(norm(x)); x + mlp(norm(x))] -> norm -> lm_head, for the
model types of arch/ (Qwen2, ...: what a type changes, such as q/k/v bias, per-head q/k norms or
scaled rotary frequencies, its Architecture says).

References: HF transformers' modeling_qwen2 (and the other types' modeling files), which the tests use
as the reference: RMSNorm computed in float32, grouped-query attention, rotary embeddings in the
half-rotation (NeoX) layout, SwiGLU MLP.

The decoder builds its projections fused: q/k/v as one `qkv_proj`, gate/up as one `gate_up_proj`
(one matmul each). The loader concatenates the checkpoint's tensors into them, row blocks in order
(`checkpoint_layout`); all other names are the HF checkpoint's. Linears are qlite's `Linear` or, where
the config's quantization says so, `QuantLinear`; a fused projection whose parts have different
formats (one skipped, say) is a `SplitLinear` of the parts. The small ops (RMSNorm, SiLU * up,
attention) go through `self.ops`: `TorchOps` here, the reference; backends.py may install faster ones.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import kv_quant
from .arch.rope import dynamic_inv_freq
from .config import Qwen2Config
from .qembedding import QuantEmbedding
from .qlinear import QuantLinear

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class Linear(nn.Linear):
    """nn.Linear whose matmul a backend may replace with a kernel of its own (kernels.py)."""
    kernel = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) if self.kernel is None else self.kernel(x)


class SplitLinear(nn.ModuleDict):
    """Projections of one input kept apart (their formats differ); their outputs side by side."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([linear(x) for linear in self.values()], dim=-1)


def make_linear(cfg: Qwen2Config, prefix: str, in_features: int, parts: dict[str, int], bias: bool) -> nn.Module:
    """The linear(s) for checkpoint modules prefix+part (out_features each) that read one input: one
    fused module when they share a format, else a SplitLinear."""
    fmts = {part: cfg.quantization.format_for(prefix + part) if cfg.quantization else None for part in parts}

    def one(fmt, out_features, where):
        if fmt is None:
            return Linear(in_features, out_features, bias=bias)
        fmt.check(in_features, where)
        return QuantLinear(in_features, out_features, bias, fmt, cfg.quantization.input_order)

    if len(set(fmts.values())) > 1:
        return SplitLinear({part: one(fmts[part], n, prefix + part) for part, n in parts.items()})
    linear = one(next(iter(fmts.values())), sum(parts.values()), prefix + next(iter(parts)))
    if len(parts) > 1:
        linear.fused_parts = tuple(parts.items())  # (checkpoint name, rows) in order
    return linear


@dataclass
class Step:
    """What every layer of one forward shares: rotary cos/sin (float32, (B, 1, T, head_dim)), the KV
    cache (None: no cache), the attention mask (None: plain causal), where the new tokens start, and
    for a padded batch whose rows' tokens are each one run to the end, where each row's keys start
    (`key_starts`); padded: whether rows are padded at all (else the mask is plain causal from `start`).
    one_at_a_time: several new tokens of one sequence whose every number must be what one-token steps give
    (Qwen2ForCausalLM.forward's `exact`): the fused decode layers may take them (fused.py)."""
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
    def argmax_rows(logits: torch.Tensor) -> tuple[list[int], list[bool]]:
        """Per row of logits (B, V): the index of the largest, and whether all are finite."""
        rows = logits.float()
        return rows.argmax(-1).tolist(), torch.isfinite(rows).all(-1).tolist()


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

    def __init__(self, cfg: Qwen2Config):
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


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class KVCache:
    """Keys and values of every layer: (layers, B, n_kv_heads, capacity, record), a record being a
    token's head_dim values in the model's dtype (bits 16) or kv_quant's int8 / int4 records (uint8
    bytes). It starts at `capacity` tokens and grows (doubling, copied) as tokens arrive, up to `limit`:
    memory follows what a generation uses, not what it might."""

    def __init__(self, cfg: Qwen2Config, batch: int, capacity: int, dtype: torch.dtype, device="cpu",
                 limit: int | None = None, kv_bits: int = 16, k_offset: torch.Tensor | None = None):
        # k_offset: float32 (layers, n_kv, head_dim) taken off the keys a quantized cache stores (Qwen2ForCausalLM.key_offsets)
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


class Attention(nn.Module):
    ops = TorchOps

    def __init__(self, cfg: Qwen2Config, layer_idx: int):
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


class MLP(nn.Module):
    ops = TorchOps

    def __init__(self, cfg: Qwen2Config, layer_idx: int):
        super().__init__()
        prefix, inter = f"model.layers.{layer_idx}.mlp.", cfg.intermediate_size
        self.gate_up_proj = make_linear(cfg, prefix, cfg.hidden_size, {"gate_proj": inter, "up_proj": inter}, bias=False)
        self.down_proj = make_linear(cfg, prefix, inter, {"down_proj": cfg.hidden_size}, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen2Config, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, layer_idx)

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), step)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2Model(nn.Module):
    fused_layers = None  # a backend's one-call decode step over every layer (fused.FusedLayers), or None

    def __init__(self, cfg: Qwen2Config):
        super().__init__()
        fmt = cfg.quantization.embeddings if cfg.quantization else None
        if fmt is not None:
            fmt.check(cfg.hidden_size, "model.embed_tokens")
        # the table is the loader's to fill: no random init (on the meta device nn.Embedding's
        # normal_ would import torch._dynamo, 2 s of a 16-bit model's load)
        self.embed_tokens = (nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
                             if fmt is None else QuantEmbedding(cfg.vocab_size, cfg.hidden_size, fmt))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg)


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


class Qwen2ForCausalLM(nn.Module):
    ops = TorchOps  # for what decoding does with the logits (argmax_rows)
    # tokens per forward when a prompt goes into a cache: its activations (the MLP's T x 2 intermediate
    # above all) are bounded by this, not by the prompt's length; as llama.cpp's default micro-batch
    prefill_chunk = 512
    kv_bits = 16  # the KV cache's: 16 (the model's dtype), 8 or 4 (kv_quant's records); --kv-cache sets it
    KEY_OFFSET_SPAN = 4096  # positions the key offsets average over

    def __init__(self, cfg: Qwen2Config):
        super().__init__()
        self.config = cfg
        self.model = Qwen2Model(cfg)
        self.lm_head = make_linear(cfg, "", cfg.hidden_size, {"lm_head": cfg.vocab_size}, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """A tied head uses the embedding table when both have one format (qconfig.shares_table)."""
        q, embed = self.config.quantization, self.model.embed_tokens
        if not self.config.tie_word_embeddings or q is not None and not q.shares_table(True):
            return
        if isinstance(embed, QuantEmbedding):
            for name, t in embed.stored().items():
                setattr(self.lm_head, name, t)
        else:
            self.lm_head.weight = embed.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    def new_cache(self, batch: int, capacity: int, limit: int | None = None) -> KVCache:
        offsets = None if self.kv_bits == 16 else self.key_offsets()
        return KVCache(self.config, batch, capacity, self.dtype, self.device, limit, self.kv_bits, offsets)

    def key_offsets(self) -> torch.Tensor | None:
        """Per layer and kv head, the rotated k bias averaged over positions 0..KEY_OFFSET_SPAN-1,
        float32 (layers, n_kv, head_dim); None for a model without k bias. A quantized cache stores the
        keys less it: Qwen2's k biases give every key a large, nearly constant part (key norms of
        100-280 in the demo model's first layers) that per-token scales would spend their range on, and
        softmax does not see a constant added to all of a head's keys. Computed once."""
        if getattr(self, "_key_offsets", False) is False:
            biases = [layer.self_attn.key_bias() for layer in self.model.layers]
            self._key_offsets = None if any(b is None for b in biases) else self._rotated_mean(biases)
        return self._key_offsets

    @torch.no_grad()
    def _rotated_mean(self, biases: list[torch.Tensor]) -> torch.Tensor:
        attn = self.model.layers[0].self_attn
        positions = torch.arange(self.KEY_OFFSET_SPAN, device=self.device)[None]  # (1, span)
        cos, sin = self.model.rotary(positions)  # (1, 1, span, head_dim)
        b = torch.stack(biases).float().view(len(biases), attn.n_kv, 1, attn.head_dim)  # (layers, n_kv, 1, hd)
        return apply_rope(b, cos[0], sin[0]).mean(dim=2).contiguous()  # (layers, n_kv, head_dim)

    def forward(self, input_ids: torch.Tensor, cache: KVCache | None = None, positions: torch.Tensor | None = None,
                key_mask: torch.Tensor | None = None, last_only: bool = False, exact: bool = False,
                head: bool = True) -> torch.Tensor | None:
        """Logits (B, T or 1, vocab) for input_ids (B, T), appended to `cache` if given (then in
        forwards of at most prefill_chunk tokens). key_mask (B, cache.length + T), True for real tokens,
        is needed only for padded batches; positions (B, T) default to cache.length + 0..T-1. head=False:
        the cache filled, no logits (None): a prompt's chunks before its last.
        Where the products are row-exact and attention reads the cache back as a step does (backends.exact_prefill:
        the native bf16 run), every logit is bitwise what one-token steps give, however the tokens are cut.
        exact (unpadded rows, a cache, T <= native.MAX_ROWS): the rotary angles token by token too, as steps
        compute them (they differ for dynamic NTK), and the fused decode layers may take the T tokens
        (speculative decoding's verify pass, speculate.py)."""
        B, T = input_ids.shape
        start = cache.length if cache is not None else 0
        if cache is not None:
            cache.reserve(start + T)
        if positions is None:
            positions = torch.arange(start, start + T, device=input_ids.device).expand(B, T)
        if exact:
            if cache is None or key_mask is not None or T > self.prefill_chunk:
                raise ValueError("exact: unpadded rows appended to a cache, in one chunk")
            angles = [self.model.rotary(positions[:, t:t + 1]) for t in range(T)]  # each as its step has it
            cos, sin = torch.cat([c for c, _ in angles], 2), torch.cat([s for _, s in angles], 2)
        else:
            cos, sin = self.model.rotary(positions)  # (B, 1, T, head_dim): all at once, as one forward has them
        chunk, kept = T if cache is None else self.prefill_chunk, []
        for a in range(0, T, chunk):
            x = self.hidden_states(input_ids[:, a:a + chunk], cos[:, :, a:a + chunk], sin[:, :, a:a + chunk], cache,
                                   None if key_mask is None else key_mask[:, :start + a + chunk], exact)  # (B, chunk, hidden)
            kept += [] if last_only or not head else [x]
        if not head:
            return None
        x = x[:, -1:] if last_only else torch.cat(kept, dim=1)  # (B, T or 1, hidden)
        return self.lm_head(self.model.norm(x))

    def hidden_states(self, input_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None,
                      key_mask: torch.Tensor | None, one_at_a_time: bool = False) -> torch.Tensor:
        """The decoder layers' output (B, T, hidden) for input_ids (B, T) after the cache's tokens."""
        T, start = input_ids.shape[1], cache.length if cache is not None else 0
        step = Step(cos, sin, cache, attention_mask(T, start, key_mask, input_ids.device), start,
                    key_starts(key_mask[:, :start + T]) if key_mask is not None else None, one_at_a_time,
                    padded=key_mask is not None)
        x = self.model.embed_tokens(input_ids).to(self.dtype)  # (B, T, hidden)
        fused = self.model.fused_layers
        if fused is not None and fused.takes(x, step):
            x = fused(x, step)
        else:
            for layer in self.model.layers:
                x = layer(x, step)
        if cache is not None:
            cache.length += T
        return x


def checkpoint_module(name: str) -> str:
    """The checkpoint's name for a module of the model: a SplitLinear's parts drop the fused name."""
    return re.sub(r"\.(?:qkv_proj|gate_up_proj)\.", ".", name)


def linear_parts(name: str, linear: nn.Module) -> list[tuple[str, int]]:
    """(checkpoint module name, rows) of each part of a linear module, in row order: one for a plain
    linear, the fused projections' parts for qkv_proj / gate_up_proj."""
    parent, _, own = checkpoint_module(name).rpartition(".")
    parts = getattr(linear, "fused_parts", None) or ((own, linear.out_features),)
    return [(f"{parent}.{part}".lstrip("."), rows) for part, rows in parts]


SHARED_BY_PARTS = ("input_order",)  # buffers of a fused linear that every part holds whole (equal), not by rows


def checkpoint_layout(model: nn.Module) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """For every tensor of the model's state dict, the checkpoint tensors (name, shape) whose rows,
    concatenated in order, make it (SHARED_BY_PARTS: each part holds it whole). A tensor shared with
    another (tied lm_head) is listed once."""
    modules = dict(model.named_modules())
    layout, seen = {}, set()
    for key, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        module, _, tensor = key.rpartition(".")
        if getattr(modules[module], "fused_parts", None) is None:
            layout[key] = [(f"{checkpoint_module(module)}.{tensor}".lstrip("."), tuple(t.shape))]
        else:
            layout[key] = [(f"{part}.{tensor}", tuple(t.shape) if tensor in SHARED_BY_PARTS else (rows, *t.shape[1:]))
                           for part, rows in linear_parts(module, modules[module])]
    return layout


def checkpoint_shapes(layout: dict[str, list[tuple[str, tuple[int, ...]]]]) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor a layout names, with its shape."""
    return {name: shape for parts in layout.values() for name, shape in parts}
