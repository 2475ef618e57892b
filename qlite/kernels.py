"""Matmul kernels for QuantLinear and 16-bit Linear layers. A kernel is an object made once at load
for one layer (`Kernel(layer)`, when `Kernel.supports(layer)`); it owns whatever packed tensors it
needs and is called with the activations. backends.py says which kernels a backend tries, in order.

- reference: dequantize the whole weight, then F.linear. Exact and slow; what tests compare against.
- aten (CPU): torch's shipped weight-only kernels, fed bf16 activations (far slower fed float32): `_weight_int8pack_mm` for per-channel int8, `_weight_int4pack_mm_for_cpu` for int4
  (a copy of the weights repacked once with `_convert_weight_to_int4pack_for_cpu`).
- native (CPU with AVX-512 BF16, or AVX2 + FMA): qlite's own kernels (native.py) on the canonical
  buffers as stored: a matrix-vector product for decoding (up to MAX_ROWS rows per sequence, any number
  of sequences), and for more rows (prefill) the weight dequantized to bf16 and bf16 matmuls
  (bucketed_linear; float32 ones on AVX2, which has no bf16 arithmetic). No copy, so memory holds the
  checkpoint's bytes.
- vnni (CPU with AVX-512 VNNI, or AVX2): the same, but the product quantizes the activations and
  multiplies in integers, as llama.cpp does, in one product "in lanes" (csrc/lanes.h), a scale per row
  and group of at most 128 inputs and integer sums per group: int4 weights meet int8 activations, int8
  weights int16 ones, at every row count, decode and prefill, so each row's result is the same at any row
  count (which the prompt cache needs: backends.exact_prefill). vpdpbusd / vpdpwssd, or on AVX2 vpmaddubsw /
  vpmaddwd.
- native-lowbit (CPU with AVX-512 BF16, or AVX2 + FMA): int3k / int2k with bf16 activations, as native's int4
  (csrc/lowbit.h); a prefill dequantizes to bf16. vnni-lowbit (AVX-512 VNNI or AVX2): int3k / int2k in lanes with
  int8 activations, as vnni's int4, at every row count.
- a rotated format (int4h, int3h: formats.Rotated) runs on its base format's native kernels, whose product turns the
  activations first (native.Product.turn_with: csrc/turn.h); aten has no turn, so without native kernels the
  reference runs it.
- bnb: bitsandbytes' own matmuls for its formats (NF4 `matmul_4bit`; LLM.int8 `matmul` with its 6.0
  outlier threshold), for comparing those formats; slow on the CPU."""
from __future__ import annotations

import sys
import threading

import torch
import torch.nn.functional as F

from . import native
from .formats import Int4, Int8, IntLowK, LLMInt8, NF4, load_bitsandbytes, nf4_codebook, unpack_int4
from .qlinear import reference_linear


def _bias(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y + bias.to(y.dtype)


def _on_cpu(layer) -> bool:
    return layer.qweight.device.type == "cpu"


class Reference:
    name = "reference"
    exact_rows = 0  # torch's matmuls: a row's bits may depend on the rows beside it

    @staticmethod
    def supports(layer) -> bool:
        return True

    def __init__(self, layer):
        self.layer = layer

    def __call__(self, x):
        return reference_linear(self.layer, x)


class AtenInt8:
    """torch's kernel reads the weight in 16-byte vectors without checking: from 4 rows on it
    crashes (SIGSEGV) on a K that is not a multiple of 16 or a weight not 16-byte aligned (a view of
    the mapped file, where the offset is the file's). So K is a precondition, and a misaligned
    weight is copied once at load."""
    name = "aten-int8"
    ALIGN = 16

    @staticmethod
    def supports(layer) -> bool:
        return (isinstance(layer.fmt, Int8) and layer.fmt.group_size is None and _on_cpu(layer)
                and layer.in_features % AtenInt8.ALIGN == 0)

    def __init__(self, layer):
        self.bias, self.shape = layer.bias, (layer.out_features, layer.in_features)
        w = layer.qweight.contiguous()
        self.qweight = w if w.data_ptr() % AtenInt8.ALIGN == 0 else w.clone()  # clone: allocator-aligned (64)
        self.scales = layer.scales[:, 0].to(torch.bfloat16)  # (N,)

    def __call__(self, x):
        N, K = self.shape
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, K).to(torch.bfloat16), self.qweight, self.scales)
        return _bias(y.to(x.dtype).reshape(*x.shape[:-1], N), self.bias)


class AtenInt4:
    name = "aten-int4"
    GROUP_SIZES = (32, 64, 128, 256)
    INNER_K_TILES = 2

    @staticmethod
    def supports(layer) -> bool:
        return (isinstance(layer.fmt, Int4) and layer.fmt.group_size in AtenInt4.GROUP_SIZES
                and layer.fmt.input_signs() is None  # a rotated format's turn is native's (else: the reference)
                and layer.in_features % 64 == 0 and _on_cpu(layer)
                and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"))

    def __init__(self, layer):
        N, K = self.shape = layer.out_features, layer.in_features
        self.bias, self.group_size = layer.bias, layer.fmt.group_size
        pad = -N % 16  # the kernel packs rows in tiles of 16: pad with zero rows, slice them off after
        codes = F.pad(unpack_int4(layer.qweight, K).to(torch.int32), (0, 0, 0, pad))  # (N + pad, K)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, AtenInt4.INNER_K_TILES)
        # canonical w = (q - z) * s; the kernel computes (q - 8) * s + zero, so zero = (8 - z) * s
        s, z = layer.fmt.group_scales(layer.stored()), layer.zeros.float()
        scales_zeros = torch.stack([s, (8 - z) * s], dim=-1)  # (N, groups, 2)
        scales_zeros = F.pad(scales_zeros, (0, 0, 0, 0, 0, pad)).transpose(0, 1).contiguous()  # (groups, N + pad, 2)
        self.scales_zeros = scales_zeros.to(torch.bfloat16)

    def __call__(self, x):
        N, K = self.shape
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, K).to(torch.bfloat16), self.packed,
                                                      self.group_size, self.scales_zeros)
        return _bias(y[:, :N].to(x.dtype).reshape(*x.shape[:-1], N), self.bias)


def row_bucket(rows: int) -> int:
    """The row count a bf16 matmul of `rows` rows runs at: a multiple of 16, and past 256 rows of an
    eighth of the power of two below: at most 12.5% or 15 rows of padding, 48 shapes up to 4096 rows."""
    step = max(16, 1 << max(0, rows.bit_length() - 4))  # rows in [2^k, 2^(k+1)): 2^(k-3)
    return -(-rows // step) * step


def bucketed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear with x's rows zero-padded up to row_bucket. oneDNN compiles a bf16 matmul per row
    count and keeps each (~0.75 MB, up to 1024 of them): with every prefill length its own shape, a
    server's memory grew by ~2.5 MB per new prompt length, without bound in practice."""
    rows = x.reshape(-1, x.shape[-1])  # (M, K)
    M, bucket = rows.shape[0], row_bucket(rows.shape[0])
    if bucket != M:
        rows = torch.cat([rows, rows.new_zeros(bucket - M, rows.shape[1])])
    return F.linear(rows, weight, bias)[:M].reshape(*x.shape[:-1], weight.shape[0])


_scratch = threading.local()
SCRATCH_MAX = 128 * 2**20  # elements: the largest bf16 weight kept for reuse between calls (256 MB)


def dequantize_buffer(N: int, K: int) -> torch.Tensor:
    """A bf16 [N, K] to dequantize a weight into for one matmul: this thread's reused buffer (a fresh
    17 MB allocation per layer per prefill costs its page faults: 3 of every 4 prefill milliseconds on
    the demo model), or a new tensor beyond SCRATCH_MAX. Never an inference tensor, though made under
    torch.inference_mode: a later call outside it (a layer with a bias that requires grad) could not use one."""
    if N * K > SCRATCH_MAX:
        return torch.empty(N, K, dtype=torch.bfloat16)
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < N * K:
        with torch.inference_mode(False):
            buf = _scratch.buf = torch.empty(N * K, dtype=torch.bfloat16)
    return buf[:N * K].view(N, K)


def sequence_rows(x: torch.Tensor) -> int:
    """The rows of one sequence in x (B, T, in) or (T, in): the native kernels choose their path by
    it, not by B x T, so a sequence's numbers never depend on the sequences batched with it."""
    return x.shape[-2] if x.dim() > 1 else 1


class _Native:
    """Up to max_rows rows per sequence: the kernel's matrix-vector product (over all B x T rows);
    more: the weight dequantized to bf16 (into dequantize_buffer) for this call only, and one matmul
    in native.matmul_dtype() (bf16; float32 with the AVX2 kernels), read at load. exact_rows: the rows
    per sequence up to which each row's result is the same at any row count and in any batch (the
    products'; the matmul's are not)."""
    max_rows = native.MAX_ROWS
    deferrable = True  # may make its buffers on first use (use_backend: a mixture's experts)

    @property
    def exact_rows(self) -> int:
        return self.max_rows
    copies = ()  # the layer's buffers this kernel keeps a copy of, in its own layout (the load drops their pages)

    def __init__(self, layer, release=None, deferred: bool = False):
        """deferred: its buffers made (codes tiled, ...) on first use, then release(t) of each buffer it copied
        (a mixture's expert: one no token chooses is never read, so never paged in)."""
        self.layer, self.release, self.bias, self.deferred = layer, release, layer.bias, deferred
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.matmul_dtype = native.matmul_dtype()
        self._product = None
        if not deferred:
            self.build()

    def build(self) -> None:
        self.stored = self.own_buffers(self.layer)
        self._product = self.prepare(**self.stored, bias32=native.float_bias(self.layer.bias))
        signs = self.layer.fmt.input_signs()
        if signs is not None:  # a rotated format: the product turns x first
            self._product.turn_with(signs)
        for buffer in self.copies if self.release else ():
            self.release(getattr(self.layer, buffer))

    def unbuild(self) -> None:
        """A deferred kernel's buffers let go (made again on next use)."""
        if self.deferred:
            self.stored, self._product = None, None

    @property
    def product(self) -> native.Product:
        if self._product is None:
            self.build()
        return self._product

    @staticmethod
    def own_buffers(layer) -> dict:
        return {name: t.contiguous() for name, t in layer.stored().items()}  # by native's argument names

    def __call__(self, x):
        if sequence_rows(x) <= self.max_rows:
            return self.product(x).to(x.dtype)
        self.product  # noqa: B018  (built: its buffers)
        weight = self.dequantize(**self.stored, out=dequantize_buffer(self.out_features, self.in_features))
        xs = self.product.turned(x)  # the codes' basis (a rotated format's)
        return _bias(bucketed_linear(xs.to(self.matmul_dtype), weight.to(self.matmul_dtype)).to(x.dtype), self.bias)


class NativeInt8(_Native):
    name = "native-int8"
    prepare, dequantize = staticmethod(native.int8_product), staticmethod(native.dequantize_int8)

    @staticmethod
    def supports(layer) -> bool:
        groups = layer.fmt.groups(layer.in_features) if isinstance(layer.fmt, Int8) else 0
        return (groups > 0 and (layer.in_features // groups) % 32 == 0 and groups <= native.MAX_GROUPS
                and _on_cpu(layer) and native.library() is not None)


class NativeInt4(_Native):
    name = "native-int4"
    prepare, dequantize = staticmethod(native.int4_product), staticmethod(native.dequantize_int4)

    @staticmethod
    def supports(layer) -> bool:
        return (isinstance(layer.fmt, Int4) and layer.fmt.group_size % 64 == 0
                and layer.in_features % layer.fmt.group_size == 0 and _on_cpu(layer)
                and layer.fmt.groups(layer.in_features) <= native.MAX_GROUPS and native.library() is not None)


class NativeLowBit(_Native):
    """int3k / int2k: qlite's products with bf16 activations (float32 on AVX2), codes unpacked by a shift and a
    mask 32 inputs at a time (csrc/lowbit.h); a prefill dequantizes to bf16 for one matmul."""
    name = "native-lowbit"
    prepare, dequantize = staticmethod(native.lowbit_product), staticmethod(native.dequantize_lowbit)

    @staticmethod
    def supports(layer) -> bool:
        return (isinstance(layer.fmt, IntLowK) and layer.in_features % native.CHUNK == 0 and _on_cpu(layer)
                and layer.fmt.groups(layer.in_features) <= native.LOWBIT_MAX_GROUPS and native.library() is not None)

    @staticmethod
    def own_buffers(layer) -> dict:
        return {**_Native.own_buffers(layer), "bits": layer.fmt.bits}


class VnniLowBit(NativeLowBit):
    """int3k / int2k with int8 activations in k order and integer dot products in lanes (csrc/lanes.h), as VnniInt4:
    one product at every row count, prefill included, each row's result the same at any row count, and the same bits
    on AVX-512 (16 rows a vector, vpdpbusd) as on AVX2 (8, vpmaddubsw). Codes and scale bytes tiled
    (native.tile_lowbit): copies made at load in place of the file's."""
    name = "vnni-lowbit"
    copies = ("qweight", "scales")
    exact_rows = sys.maxsize
    prepare = staticmethod(native.vnni_lowbit_product)

    def __call__(self, x):
        return self.product(x).to(x.dtype)

    @staticmethod
    def supports(layer) -> bool:
        return NativeLowBit.supports(layer) and native.lowbit_lanes_fit(layer.in_features, layer.fmt.group_size)

    @staticmethod
    def own_buffers(layer) -> dict:
        stored = NativeLowBit.own_buffers(layer)
        codes, scale_bytes = native.tile_lowbit(stored["qweight"], stored["scales"])
        return {**stored, "qweight": codes, "scales": scale_bytes}


def _vnni_fits(layer) -> bool:
    return native.vnni_ready() and native.vnni_fits(layer.in_features, layer.in_features // layer.fmt.groups(layer.in_features))


class _TiledCodes:
    """The integer-activation products take their codes tiled (native.tile_codes): a copy made at load in
    place of the file's, whose pages the load then drops."""
    copies = ("qweight",)

    @staticmethod
    def own_buffers(layer) -> dict:
        stored = _Native.own_buffers(layer)
        return {**stored, "qweight": native.tile_codes(stored["qweight"])}


class VnniInt8(_TiledCodes, NativeInt8):
    """NativeInt8 with the activations quantized to int16: integer dot products (AVX-512 VNNI, or AVX2) in
    one product at every row count, prefill included, each row's result the same at any row count. On the
    demo's q4 file (Zen 4) a prefill of 128-2048 tokens takes as long as with dequantize + bf16 matmul past
    16 rows, the limit this kernel had (BENCHMARKS.md, issue 54). Codes tiled (_TiledCodes)."""
    name = "vnni-int8"
    max_rows = sys.maxsize

    def __call__(self, x):
        return self.product(x).to(x.dtype)

    @staticmethod
    def prepare(qweight, scales, bias32):
        return native.vnni_product(qweight, scales, None, bias32)

    @staticmethod
    def supports(layer) -> bool:
        return NativeInt8.supports(layer) and _vnni_fits(layer)


def dequantized_for_prefill(fmt, in_features: int) -> bool:
    """Whether a prefill dequantizes a quantized layer of this format to bf16 for one matmul (fit.py's
    scratch): not the layers an integer-activation product takes (VnniInt4, VnniInt8, VnniLowBit: every row count)."""
    group_size = in_features // fmt.groups(in_features)
    if isinstance(fmt, IntLowK):
        return not native.lowbit_lanes_fit(in_features, group_size)
    return not (isinstance(fmt, (Int4, Int8)) and native.vnni_ready() and native.vnni_fits(in_features, group_size))


class VnniInt4(_TiledCodes, NativeInt4):
    """The same for int4 weights, with int8 activations (llama.cpp's numerics, a scale per group); groups
    of 32 too (NativeInt4's own product needs 64). One product at every row count, prefill included (in
    lanes, csrc/lanes.h), faster than dequantize + matmul from 128 rows at 7B's shapes (BENCHMARKS.md,
    "Prefill at real sizes"), and each row's result the same at any row count. Codes tiled
    (native.tile_codes), a copy made at load in place of the file's: the decode product streams them as
    one stream, which CPUs prefetch better than 4 (BENCHMARKS.md, "Decode at 7B: tiled codes")."""
    name = "vnni-int4"
    prepare = staticmethod(native.vnni_product)
    exact_rows = sys.maxsize

    def __call__(self, x):
        return self.product(x).to(x.dtype)

    @staticmethod
    def supports(layer) -> bool:
        return isinstance(layer.fmt, Int4) and _on_cpu(layer) and _vnni_fits(layer)


class NativeBf16:
    """A 16-bit Linear's few-row products (per sequence) with a bf16 CPU weight, through native.gemv_bf16; every
    row count for a layer whose rows must not depend on the rows beside them (`row_exact`: a mixture's router,
    whose choices a prefill and a step must agree on; a small matrix, cheap either way)."""
    name = "native-bf16"

    @staticmethod
    def supports(layer) -> bool:
        w = layer.weight
        return (w.dtype == torch.bfloat16 and w.device.type == "cpu" and w.is_contiguous()
                and layer.in_features % 64 == 0 and native.library() is not None)

    def __init__(self, layer):
        self.weight, self.bias = layer.weight, layer.bias
        self.product = native.bf16_product(layer.weight, native.float_bias(layer.bias))
        self.matmul_dtype = native.matmul_dtype()
        self.exact_rows = sys.maxsize if getattr(layer, "row_exact", False) else native.MAX_ROWS

    def __call__(self, x):
        if sequence_rows(x) <= self.exact_rows:
            return self.product(x).to(x.dtype)
        dtype = self.matmul_dtype
        bias = None if self.bias is None else self.bias.to(dtype)
        return bucketed_linear(x.to(dtype), self.weight.to(dtype), bias).to(x.dtype)


class BnbNF4:
    name = "bnb-nf4"

    @staticmethod
    def supports(layer) -> bool:
        return isinstance(layer.fmt, NF4)

    def __init__(self, layer):
        self.qweight, self.bias = layer.qweight, layer.bias
        self.state = load_bitsandbytes().functional.QuantState(
            absmax=layer.absmax.reshape(-1), shape=torch.Size([layer.out_features, layer.in_features]),
            code=nf4_codebook().to(layer.qweight.device), blocksize=layer.fmt.group_size, quant_type="nf4",
            dtype=torch.bfloat16)

    def __call__(self, x):
        import bitsandbytes as bnb
        y = bnb.matmul_4bit(x.to(torch.bfloat16), self.qweight.view(-1, 1).t(), quant_state=self.state)
        return _bias(y.to(x.dtype), self.bias)


class BnbInt8:
    name = "bnb-llm.int8"
    THRESHOLD = 6.0  # LLM.int8's outlier threshold: activation columns above it stay 16-bit

    @staticmethod
    def supports(layer) -> bool:
        return isinstance(layer.fmt, LLMInt8)

    def __init__(self, layer):
        self.qweight, self.bias = layer.qweight, layer.bias
        self.state = load_bitsandbytes().MatmulLtState()
        self.state.CB, self.state.SCB, self.state.threshold = layer.qweight, layer.scb, BnbInt8.THRESHOLD
        self.state.has_fp16_weights, self.state.is_training = False, False

    def __call__(self, x):
        import bitsandbytes as bnb
        y = bnb.matmul(x.to(torch.float16), self.qweight, state=self.state)  # it works in fp16
        return _bias(y.to(x.dtype), self.bias)
