"""The backend seam: a backend, picked once at load by name (`--kernel`), says which kernel runs each
quantized and each 16-bit linear layer, and which small ops (RMSNorm, SiLU * up, attention) the
decoder calls. The model math itself (decoder/) never asks which backend it runs on.

| backend    | quantized linears                                       | 16-bit linears | small ops        |
|------------|---------------------------------------------------------|----------------|------------------|
| reference  | dequantize + F.linear                                   | torch          | torch            |
| aten       | torch's int8/int4 CPU kernels                           | torch          | torch            |
| native     | qlite's C kernels, decoding with integer activations where the CPU (VNNI) and the groups allow, else as native-a16 | qlite's C GEMV | qlite's C ops |
| native-a16 | qlite's C kernels, activations bf16 (the stored weights' exact products; int3k / int2k always) | qlite's C GEMV | qlite's C ops |
| bnb        | bitsandbytes' nf4 / LLM.int8                            | torch          | torch            |
| auto       | native, else aten, else bnb, else reference, per layer  | native if it can | native if it can |

A backend that cannot run a layer (`--kernel native` on a CPU without AVX2 or a C compiler, say) is a
one-line error naming the layer. A new kernel is one class in kernels.py plus its place in this table."""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch import nn

from . import native, native_moe
from .errors import QliteError
from .kernels import (AtenInt4, AtenInt8, BnbInt8, BnbNF4, NativeBf16, NativeInt4, NativeInt8, NativeLowBit, Reference,
                      VnniInt4, VnniInt8, VnniLowBit)
from .fused import FusedLayers
from .decoder.causal_lm import Decoder
from .decoder.linear import Linear
from .decoder.mlp import SparseMLP
from .decoder.ops import Step, TorchOps
from .qlinear import QuantLinear


class NativeOps(TorchOps):
    """qlite's C ops where they take the tensors (bf16 on the CPU), torch's otherwise."""
    name = "native"

    @staticmethod
    def rmsnorm(x, weight, eps):
        if weight.dtype == torch.bfloat16 and native.bf16_ready(x):
            return native.rmsnorm(x, weight, eps)  # the same computation, one call
        return TorchOps.rmsnorm(x, weight, eps)

    @staticmethod
    def silu_mul(gate_up):
        return native.silu_mul(gate_up) if native.bf16_ready(gate_up) else TorchOps.silu_mul(gate_up)

    @staticmethod
    def attention(qkv, step: Step, attn):
        """New tokens, bf16, with a bf16 or quantized cache (plain, or left-padded rows): rotary, cache write
        and attention in one call a row, every token's attention as a one-token step computes it. One rule
        for every key and value: read back from the cache's records, by the same arithmetic, whether a
        prompt's own (prefill), an earlier step's, or a prefix the prompt cache held; so a prompt's numbers
        do not depend on how it was cut into forwards or what the cache held (issue 54)."""
        B, T, _ = qkv.shape
        cache = step.cache
        if not (cache is not None and (not step.padded or step.key_starts is not None) and native.bf16_ready(qkv)
                and attn.head_dim % 32 == 0 and native.cache_ready(cache.k, cache.kv_bits)):
            return TorchOps.attention(qkv, step, attn)
        k, v = cache.k[attn.layer_idx], cache.v[attn.layer_idx]  # (B, n_kv, capacity, record)
        offset = None if cache.k_offset is None else cache.k_offset[attn.layer_idx]
        if T == 1:
            y = native.decode_attention(qkv.view(B, -1), step.cos.reshape(B, -1), step.sin.reshape(B, -1), k, v,
                                        attn.n_head, step.start, step.key_starts, cache.kv_bits, offset)
            return y.view(B, T, -1)
        y = qkv.new_zeros(B, T, attn.n_head * attn.head_dim)  # a padding query's output: zeros (TorchOps.rows_alone)
        starts = [0] * B if step.key_starts is None else step.key_starts.tolist()
        for b, first_key in enumerate(starts):
            first = max(first_key - step.start, 0)  # the row's first real token in this forward
            if first < T:
                y[b, first:] = native.decode_attention(
                    qkv[b, first:], step.cos[b if step.cos.shape[0] > 1 else 0, 0, first:],
                    step.sin[b if step.sin.shape[0] > 1 else 0, 0, first:], k[b:b + 1], v[b:b + 1], attn.n_head,
                    step.start + first, None if step.key_starts is None else step.key_starts[b].expand(T - first),
                    cache.kv_bits, offset, one_sequence=True)
        return y

    @staticmethod
    def sparse_mlp(mlp, x):
        """In one native call (native_moe.py, the fused step's own) where the layer's products are all native."""
        described = getattr(mlp, "native", None)
        if described is not None and native.bf16_ready(x):
            return described(x.reshape(-1, x.shape[-1])).view(x.shape)
        return TorchOps.sparse_mlp(mlp, x)

    @staticmethod
    def argmax_rows(logits):
        """One pass over bf16 logits, no float32 copy."""
        return native.argmax(logits) if native.argmax_ready(logits) else TorchOps.argmax_rows(logits)


@dataclass(frozen=True)
class Backend:
    quantized: tuple  # kernel classes for QuantLinear layers, the first that supports a layer runs it
    dense: tuple  # kernel classes for 16-bit Linear layers (none that fits: torch's F.linear)
    ops: type  # the small ops
    quantized_only: bool = False  # it changes nothing for a 16-bit model: naming it there is a mistake


NATIVE_A16 = (NativeInt8, NativeInt4, NativeLowBit)
NATIVE_QUANTIZED = (VnniInt8, VnniInt4, VnniLowBit, *NATIVE_A16)
BACKENDS = {
    "reference": Backend((Reference,), (), TorchOps),
    "aten": Backend((AtenInt8, AtenInt4), (), TorchOps, quantized_only=True),
    "native": Backend(NATIVE_QUANTIZED, (NativeBf16,), NativeOps),
    "native-a16": Backend(NATIVE_A16, (NativeBf16,), NativeOps),
    "bnb": Backend((BnbNF4, BnbInt8), (), TorchOps, quantized_only=True),
    "auto": Backend((*NATIVE_QUANTIZED, AtenInt8, AtenInt4, BnbNF4, BnbInt8, Reference), (NativeBf16,), NativeOps),
}


def exact_prefill(model: nn.Module) -> bool:
    """Whether a prompt's numbers never depend on how it was cut into forwards, what a cache held or the batch
    beside it: every decoder product the same at any row count (kernel.exact_rows; torch's matmuls: never), the
    head at one row per sequence (a prefill takes it on its last token only), and attention through NativeOps,
    which reads every key and value back from the cache as a step does (bf16 on the CPU, head_dim a multiple
    of 32); and rotary angles that do not depend on the forward's length (dynamic NTK's do, past the context).
    What the prompt cache needs (engine.py)."""
    if (model.dtype != torch.bfloat16 or model.device.type != "cpu" or native.library() is None
            or model.config.head_dim % 32 or model.model.rotary.dynamic is not None
            or any(m.ops is not NativeOps for m in model.modules() if hasattr(m, "ops"))):
        return False

    def rows(m):
        return getattr(getattr(m, "kernel", None), "exact_rows", 0)
    decoder = [m for m in model.model.layers.modules() if isinstance(m, (Linear, QuantLinear))]
    return all(rows(m) == sys.maxsize for m in decoder) and rows(model.lm_head) >= 1


def backend_named(name: str) -> Backend:
    if name not in BACKENDS:
        raise QliteError(f"--kernel {name}: choose {', '.join(BACKENDS)}")
    return BACKENDS[name]


def choose_kernel(layer, name: str):
    """The first kernel class of the named backend that can run this layer, or None."""
    backend = backend_named(name)
    kernels = backend.quantized if isinstance(layer, QuantLinear) else backend.dense
    return next((k for k in kernels if k.supports(layer)), None)


def use_backend(model: nn.Module, name: str = "auto", release=None) -> None:
    """Give every linear layer of a loaded model its kernel and every module its ops, once. release(t),
    if given, is called on each layer buffer a kernel copied into a layout of its own (kernel.copies), as
    soon as it has: the loader drops the file's pages of it, one layer at a time."""
    backend = backend_named(name)
    if backend.quantized_only and not any(isinstance(m, QuantLinear) for m in model.modules()):
        raise QliteError(f"--kernel {name}: runs quantized layers, and this is a 16-bit checkpoint (use auto, "
                         "native or reference)")
    ops = backend.ops if backend.ops is TorchOps or native.library() is not None else TorchOps
    for module_name, mod in model.named_modules():
        if isinstance(mod, (QuantLinear, Linear)):
            kernel = choose_kernel(mod, name)
            if kernel is None and isinstance(mod, QuantLinear):
                raise QliteError(f"--kernel {name}: cannot run {module_name} ({mod.fmt.name}, "
                                 f"{mod.out_features}x{mod.in_features}) on {mod.qweight.device}; try --kernel auto")
            if kernel is not None and getattr(kernel, "deferrable", False) and ".mlp.experts." in module_name:
                mod.kernel = kernel(mod, release, deferred=True)  # made when a token first chooses the expert
            else:
                mod.kernel = None if kernel is None else kernel(mod)
                for buffer in getattr(mod.kernel, "copies", ()) if release else ():
                    release(getattr(mod, buffer))
        if hasattr(type(mod), "ops"):
            mod.ops = ops
    for mod in model.modules():  # once every layer has its kernel: a sparse MLP's C description
        if isinstance(mod, SparseMLP):
            mod.native = native_moe.NativeSparseMLP.build(mod, model.config.hidden_size) if ops is NativeOps else None
    for mod in model.modules():  # once every layer has its kernel
        if isinstance(mod, Decoder):
            mod.fused_layers = FusedLayers.build(mod) if ops is NativeOps else None
