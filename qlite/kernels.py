"""Dequant-matmul kernels for QuantLinear.

- reference: dequantize the whole weight, then F.linear. Exact and slow; what tests compare against.
- aten (CPU): torch's shipped weight-only kernels, fed bf16 activations (they are 10-70x slower fed
  float32): `_weight_int8pack_mm` for per-channel int8, `_weight_int4pack_mm_for_cpu` for int4
  (weights repacked once with `_convert_weight_to_int4pack_for_cpu`).
- native (CPU with AVX-512 BF16): qlite's own kernels (native.py) on the canonical buffers as stored:
  a matrix-vector product for decoding (up to MAX_ROWS rows), and for more rows (prefill) the weight
  dequantized to bf16 and one bf16 matmul. No repacking, so memory holds the checkpoint's bytes.
- bnb: bitsandbytes' own matmuls for its formats (NF4 `matmul_4bit`; LLM.int8 `matmul` with its 6.0
  outlier threshold), for comparing those formats; slow on the CPU.
A kernel's `prepare` replaces the canonical buffers by its own (so memory holds one copy)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import native
from .formats import unpack_int4


def _bias(y: torch.Tensor, layer) -> torch.Tensor:
    return y if layer.bias is None else y + layer.bias.to(y.dtype)


class Reference:
    name = "reference"

    @staticmethod
    def supports(layer) -> bool:
        return True

    @staticmethod
    def prepare(layer) -> None:
        pass

    @staticmethod
    def forward(layer, x):
        return F.linear(x, layer.dequantize().to(x.dtype), None if layer.bias is None else layer.bias.to(x.dtype))


class AtenInt8:
    name = "aten-int8"

    @staticmethod
    def supports(layer) -> bool:
        return (layer.fmt.scheme == "int" and layer.fmt.bits == 8 and layer.fmt.group_size is None
                and layer.qweight.device.type == "cpu")

    @staticmethod
    def prepare(layer) -> None:
        scales = layer.scales[:, 0].to(torch.bfloat16)  # (N,)
        del layer.scales
        layer.register_buffer("scales", scales, persistent=False)

    @staticmethod
    def forward(layer, x):
        x2 = x.reshape(-1, layer.in_features).to(torch.bfloat16)  # (B*T, K)
        y = torch.ops.aten._weight_int8pack_mm(x2, layer.qweight, layer.scales)
        return _bias(y.to(x.dtype).reshape(*x.shape[:-1], layer.out_features), layer)


class AtenInt4:
    name = "aten-int4"
    GROUP_SIZES = (32, 64, 128, 256)
    INNER_K_TILES = 2

    @staticmethod
    def supports(layer) -> bool:
        return (layer.fmt.scheme == "int" and layer.fmt.bits == 4 and layer.fmt.group_size in AtenInt4.GROUP_SIZES
                and layer.in_features % 64 == 0 and layer.qweight.device.type == "cpu"
                and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"))

    @staticmethod
    def prepare(layer) -> None:
        N, K = layer.out_features, layer.in_features
        pad = -N % 16  # the kernel packs rows in tiles of 16: pad with zero rows, slice them off after
        codes = F.pad(unpack_int4(layer.qweight, K).to(torch.int32), (0, 0, 0, pad))  # (N + pad, K)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, AtenInt4.INNER_K_TILES)
        # canonical w = (q - z) * s; the kernel computes (q - 8) * s + zero, so zero = (8 - z) * s
        s, z = layer.scales.float(), layer.zeros.float()
        scales_zeros = torch.stack([s, (8 - z) * s], dim=-1)  # (N, groups, 2)
        scales_zeros = F.pad(scales_zeros, (0, 0, 0, 0, 0, pad)).transpose(0, 1).contiguous()  # (groups, N + pad, 2)
        for name in ("qweight", "scales", "zeros"):
            delattr(layer, name)
        layer.register_buffer("packed", packed, persistent=False)
        layer.register_buffer("scales_zeros", scales_zeros.to(torch.bfloat16), persistent=False)

    @staticmethod
    def forward(layer, x):
        x2 = x.reshape(-1, layer.in_features).to(torch.bfloat16)  # (B*T, K)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, layer.packed, layer.fmt.group_size, layer.scales_zeros)
        y = y[:, :layer.out_features].to(x.dtype).reshape(*x.shape[:-1], layer.out_features)
        return _bias(y, layer)


class _Native:
    """Up to native.MAX_ROWS rows: the kernel's matrix-vector product; more: the weight dequantized to
    bf16 for this call only, and one bf16 matmul."""

    @staticmethod
    def prepare(layer) -> None:
        for name, buf in list(layer.named_buffers()):
            setattr(layer, name, buf.contiguous())
        layer.bias32 = native.float_bias(layer.bias)

    @classmethod
    def forward(cls, layer, x):
        if x.numel() // layer.in_features <= native.MAX_ROWS:
            return cls.gemv(layer, x).to(x.dtype)
        return _bias(F.linear(x.to(torch.bfloat16), cls.dequantize(layer)).to(x.dtype), layer)


class NativeInt8(_Native):
    name = "native-int8"

    @staticmethod
    def supports(layer) -> bool:
        return (layer.fmt.scheme == "int" and layer.fmt.bits == 8 and layer.qweight.device.type == "cpu"
                and (layer.in_features // layer.scales.shape[1]) % 32 == 0
                and layer.scales.shape[1] <= native.MAX_GROUPS and native.library() is not None)

    @staticmethod
    def gemv(layer, x):
        return native.gemv_int8(x, layer.qweight, layer.scales, layer.bias32)

    @staticmethod
    def dequantize(layer):
        return native.dequantize_int8(layer.qweight, layer.scales)


class NativeInt4(_Native):
    name = "native-int4"

    @staticmethod
    def supports(layer) -> bool:
        return (layer.fmt.scheme == "int" and layer.fmt.bits == 4 and layer.fmt.group_size % 64 == 0
                and layer.in_features % layer.fmt.group_size == 0 and layer.qweight.device.type == "cpu"
                and layer.scales.shape[1] <= native.MAX_GROUPS and native.library() is not None)

    @staticmethod
    def gemv(layer, x):
        return native.gemv_int4(x, layer.qweight, layer.scales, layer.zeros, layer.bias32)

    @staticmethod
    def dequantize(layer):
        return native.dequantize_int4(layer.qweight, layer.scales, layer.zeros)


class DenseLinear(nn.Linear):
    """nn.Linear whose few-row products with a bf16 CPU weight go through native.gemv_bf16."""

    def forward(self, x):
        if x.numel() // self.in_features <= native.MAX_ROWS:
            return native.gemv_bf16(x, self.weight, self.bias32).to(x.dtype)
        return super().forward(x)


def use_native_dense(model: nn.Module) -> None:
    """Turn the bf16 CPU nn.Linear layers of a loaded model into DenseLinear (same parameters)."""
    if native.library() is None:
        return
    for mod in model.modules():
        if (type(mod) is nn.Linear and mod.weight.dtype == torch.bfloat16 and mod.weight.device.type == "cpu"
                and mod.weight.is_contiguous() and mod.in_features % 64 == 0):
            mod.__class__ = DenseLinear
            mod.bias32 = native.float_bias(mod.bias)


class BnbNF4:
    name = "bnb-nf4"

    @staticmethod
    def supports(layer) -> bool:
        return layer.fmt.scheme == "nf4"

    @staticmethod
    def prepare(layer) -> None:
        from .formats import load_bitsandbytes, nf4_codebook
        layer.bnb_state = load_bitsandbytes().functional.QuantState(absmax=layer.absmax.reshape(-1), shape=torch.Size([layer.out_features, layer.in_features]),
                                     code=nf4_codebook().to(layer.qweight.device), blocksize=layer.fmt.group_size,
                                     quant_type="nf4", dtype=torch.bfloat16)

    @staticmethod
    def forward(layer, x):
        import bitsandbytes as bnb
        y = bnb.matmul_4bit(x.to(torch.bfloat16), layer.qweight.view(-1, 1).t(), quant_state=layer.bnb_state)
        return _bias(y.to(x.dtype), layer)


class BnbInt8:
    name = "bnb-llm.int8"
    THRESHOLD = 6.0  # LLM.int8's outlier threshold: activation columns above it stay 16-bit

    @staticmethod
    def supports(layer) -> bool:
        return layer.fmt.scheme == "llm.int8"

    @staticmethod
    def prepare(layer) -> None:
        from .formats import load_bitsandbytes
        state = load_bitsandbytes().MatmulLtState()
        state.CB, state.SCB, state.threshold = layer.qweight, layer.scb, BnbInt8.THRESHOLD
        state.has_fp16_weights, state.is_training = False, False
        layer.bnb_state = state

    @staticmethod
    def forward(layer, x):
        import bitsandbytes as bnb
        y = bnb.matmul(x.to(torch.float16), layer.qweight, state=layer.bnb_state)  # it works in fp16
        return _bias(y.to(x.dtype), layer)


KERNELS = {"reference": [Reference], "native": [NativeInt8, NativeInt4], "aten": [AtenInt8, AtenInt4],
           "bnb": [BnbNF4, BnbInt8], "auto": [NativeInt8, NativeInt4, AtenInt8, AtenInt4, BnbNF4, BnbInt8, Reference]}


def choose_kernel(layer, kernel: str):
    """The first kernel of the named backend that can run this layer, or None."""
    from .errors import QliteError

    if kernel not in KERNELS:
        raise QliteError(f"--kernel {kernel}: choose {', '.join(KERNELS)}")
    return next((k for k in KERNELS[kernel] if k.supports(layer)), None)
