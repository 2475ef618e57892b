"""A decode step's decoder layers in one native call (csrc/decode_step.h: qlite_decode_layers), and a verify
pass's (speculate.py: one sequence's new tokens, each as its own step would take it), for a model
whose every linear runs a native product and whose small ops are native (backends.NativeOps). The C side
calls the very kernels the module path calls, in the same order, so the result is bitwise the same
(tested); what goes is the Python between them: ~10 module calls, checks and allocations per layer
(what that saves: BENCHMARKS.md "Decode step in one call")."""
from __future__ import annotations

import ctypes

import torch

from . import native
from .decoder.causal_lm import Decoder
from .decoder.mlp import MLP
from .decoder.linear import SplitLinear
from .decoder.ops import Step

_I, _L, _P = ctypes.c_int, ctypes.c_long, ctypes.c_void_p


class CProduct(ctypes.Structure):  # decode_step.h's qlite_product
    _fields_ = [("kind", _I), ("int4", _I), ("w", _P), ("scales", _P), ("row_scales", _P), ("zeros", _P), ("G", _L),
                ("N", _L), ("K", _L), ("bias", _P), ("bits", _I), ("signs", _P)]


class CLayer(ctypes.Structure):  # decode_step.h's qlite_layer
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("qkv", CProduct * 3), ("o", CProduct),
                ("gate_up", CProduct * 2), ("down", CProduct), ("n_qkv", _I), ("n_gate_up", _I),
                ("q_norm", _P), ("k_norm", _P), ("moe", _P)]


def c_product(product: native.Product) -> CProduct:
    fields = dict(zip(native.PRODUCT_ARGS[product.fn_name], product.weight_args))
    return CProduct(kind=list(native.PRODUCT_ARGS).index(product.fn_name), bias=native._ptr(product.bias32),
                    signs=native._ptr(product.signs), **fields)


def products(linear) -> list[native.Product] | None:
    """The native products a linear module runs (a SplitLinear's parts in order), or None where a part
    has none (another kernel) or permutes its input first (act-order GPTQ)."""
    parts = list(linear.values()) if isinstance(linear, SplitLinear) else [linear]
    found = [getattr(part.kernel, "product", None) for part in parts]
    if any(p is None for p in found) or any(getattr(part, "input_order", None) is not None for part in parts):
        return None
    return found


class FusedLayers:
    """Every layer of a decode step in one call: the table of their products and norms, built once at load."""

    def __init__(self, model: Decoder, table: ctypes.Array):
        cfg = model.layers[0].self_attn
        self.table, self.n_layers = table, len(table)
        self.hidden, self.eps = model.norm.weight.shape[0], model.norm.eps
        self.n_head, self.n_kv, self.head_dim = cfg.n_head, cfg.n_kv, cfg.head_dim
        # what the table points at besides the products (which their layers hold): kept alive here too
        self.norms = [(layer.input_layernorm.weight, layer.post_attention_layernorm.weight) for layer in model.layers]
        self.sparse = [layer.mlp.native for layer in model.layers if getattr(layer.mlp, "native", None) is not None]

    @classmethod
    def build(cls, model: Decoder) -> FusedLayers | None:
        """The fused step for a model whose kernels are set (backends.use_backend), or None where some
        part of a layer does not run natively (the module path then runs every step)."""
        if native.library() is None or not hasattr(native.library(), "qlite_decode_layers"):
            return None
        attn = model.layers[0].self_attn
        hidden, hd, q_rows = model.norm.weight.shape[0], attn.head_dim, attn.n_head * attn.head_dim
        if hidden % 32 or hd % 32 or attn.n_head % attn.n_kv:
            return None
        rows = []
        for layer in model.layers:
            a = layer.self_attn
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                     *((a.q_norm.weight, a.k_norm.weight) if hasattr(a, "q_norm") else ()))
            qkv, o = products(a.qkv_proj), products(a.o_proj)
            if (None in (qkv, o) or any(w.dtype != torch.bfloat16 for w in norms) or any(p.K != hidden for p in qkv)
                    or sum(p.N for p in qkv) != q_rows + 2 * a.n_kv * hd or (o[0].K, o[0].N) != (q_rows, hidden)):
                return None
            row = CLayer(input_norm=norms[0].data_ptr(), post_norm=norms[1].data_ptr(), o=c_product(o[0]), n_qkv=len(qkv))
            row.qkv[:len(qkv)] = [c_product(p) for p in qkv]
            if len(norms) == 4:  # Qwen3's per-head q/k norms
                row.q_norm, row.k_norm = norms[2].data_ptr(), norms[3].data_ptr()
            if isinstance(layer.mlp, MLP):
                gate_up, down = products(layer.mlp.gate_up_proj), products(layer.mlp.down_proj)
                if None in (gate_up, down):
                    return None
                inter = sum(p.N for p in gate_up) // 2
                if any(p.K != hidden for p in gate_up) or (down[0].N, down[0].K) != (hidden, inter) or inter % 32:
                    return None
                row.down, row.n_gate_up = c_product(down[0]), len(gate_up)
                row.gate_up[:len(gate_up)] = [c_product(p) for p in gate_up]
            elif getattr(layer.mlp, "native", None) is not None:  # a sparse MLP: its C description (native_moe.py)
                row.moe = ctypes.addressof(layer.mlp.native.struct)
            else:
                return None
            rows.append(row)
        return cls(model, (CLayer * len(rows))(*rows))

    def takes(self, x: torch.Tensor, step: Step) -> bool:
        """One new bf16 token per row, a bf16 or quantized cache, plain or left-padded rows (as
        NativeOps.attention); or new tokens of one sequence, each as a step of its own would take it
        (Step.one_at_a_time: speculation's verify pass)."""
        cache = step.cache
        if not (x.dtype == torch.bfloat16 and x.is_cpu and cache is not None and native.cache_ready(cache.k, cache.kv_bits)):
            return False
        if x.shape[1] == 1:
            return step.mask is None or step.key_starts is not None
        return x.shape[0] == 1 and step.one_at_a_time

    def __call__(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        """x (B, 1, hidden) -> the residual stream after every layer, (B, 1, hidden); the cache written at
        step.start. Or x (1, T, hidden), one sequence's T new tokens: T rows of one cache row at positions
        step.start + 0..T-1 (pos_step 1)."""
        B, T = x.shape[:2]
        rows, pos_step = B * T, int(T > 1)
        k, v, bits = step.cache.k, step.cache.v, step.cache.kv_bits  # (layers, B or more, n_kv, capacity, record)
        layers, cache_rows, n_kv, capacity, rec = k.shape
        hd, pos, record = self.head_dim, step.start, native.kv_record_bytes(bits, self.head_dim)
        native._check_rule((layers, n_kv, rec * k.element_size()) == (self.n_layers, self.n_kv, record)
                           and cache_rows >= B and k.stride()[2:] == (capacity * rec, rec, 1) and v.shape == k.shape
                           and v.stride() == k.stride() and 0 <= pos and pos + T <= capacity,
                           f"cache {tuple(k.shape)} at {pos}: want {bits}-bit records [{self.n_layers}, >={B}, "
                           f"{self.n_kv}, capacity >= {pos + T}, {record} bytes] rows")
        starts = native.checked_starts(step.key_starts, B, pos) if T == 1 else None
        offsets = step.cache.k_offset if bits != 16 else None
        if offsets is not None:
            native._check(offsets, torch.float32, (self.n_layers, n_kv, hd), "k_offsets")
        cos, sin = step.cos.reshape(rows, hd).contiguous(), step.sin.reshape(rows, hd).contiguous()
        out = x.reshape(rows, self.hidden).clone()  # updated in place
        row_stride = k.stride(1) * k.element_size() if T == 1 else 0  # T > 1: every row in cache row 0
        rc = native.library().qlite_decode_layers(
            ctypes.addressof(self.table), self.n_layers, out.data_ptr(), rows, self.hidden, self.eps, cos.data_ptr(),
            sin.data_ptr(), k.data_ptr(), v.data_ptr(), k.stride(0) * k.element_size(), row_stride,
            native._ptr(starts), self.n_head, n_kv, hd, capacity, pos, pos_step, bits, native._ptr(offsets),
            torch.get_num_threads())
        if rc:
            raise RuntimeError("native decode step: an expert's kernel could not be made")
        return out.view(B, T, self.hidden)
