"""qlite's own CPU kernels: matrix-vector products for decoding that read bf16, int8 and int4 weights in
their canonical layouts, dequantization to bf16 for prefill, and the small ops of a decode step (RMSNorm,
SiLU * up, rotary + KV-cache write + attention, argmax). One source per instruction set (ISAS):
csrc/kernels.c for CPUs with AVX-512 BF16 (its integer-activation products need AVX-512 VNNI too),
csrc/kernels_avx2.c for AVX2 + FMA CPUs (the same functions and numerics, 8 floats a vector), built with
AVX-VNNI's multiply-adds where the CPU has them (avxvnni: the same integers, so the same bits). The best
one the CPU runs is compiled on first use with the system C compiler into qlite's cache and loaded with
ctypes; OpenMP comes from torch's own libgomp, already loaded. QLITE_NATIVE_ISA=avx2 (or avxvnni) forces
those kernels (to measure them on a newer CPU). QLITE_NATIVE=0, no compiler, or a CPU with neither:
`library()` is None and the aten kernels run instead."""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from .errors import QliteError
from .system import cache_dir, cpu_flags

CSRC = Path(__file__).parent / "csrc"
ISAS = {  # name: (the CPU flags it needs, its source, its compiler flags), best first
    "avx512": ({"avx512_bf16", "avx512bw", "avx512vl", "f16c"}, "kernels.c", ["-march=native"]),
    # AVX2 with AVX-VNNI (Intel's client CPUs from Alder Lake): kernels_avx2.c with vpdpbusd / vpdpwssd on 8 lanes
    "avxvnni": ({"avx2", "fma", "f16c", "avx_vnni"}, "kernels_avx2.c", ["-march=x86-64-v3", "-mavxvnni", "-mtune=native"]),
    "avx2": ({"avx2", "fma", "f16c"}, "kernels_avx2.c", ["-march=x86-64-v3", "-mtune=native"]),
}
FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC"]
MAX_ROWS = 8  # up to this many activation rows go through the matrix-vector kernels
MAX_GROUPS = 1024  # common.h's MAX_GROUPS
LOWBIT_MAX_GROUPS = 2048  # common.h's LOWBIT_MAX_GROUPS
CHUNK = 128  # common.h's CHUNK: the integer-activation kernels take x and the groups in whole chunks
TURN_BLOCK = 128  # turn.h's: a rotated format's activations are turned this many inputs at a time

_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
SIGNATURES = {
    "qlite_gemv_bf16": [_P, _L, _P, _L, _L, _P, _P, _I, _I],
    "qlite_gemv_int8": [_P, _L, _P, _P, _L, _L, _L, _P, _P, _I, _I],
    "qlite_gemv_int4": [_P, _L, _P, _P, _P, _P, _L, _L, _L, _P, _P, _I, _I],
    "qlite_gemv_vnni": [_P, _L, _P, _P, _P, _P, _I, _L, _L, _L, _P, _P, _I, _I],
    "qlite_tile_codes": [_P, _P, _L, _L, _I, _I],
    "qlite_dequantize_int8": [_P, _P, _L, _L, _L, _P, _I],
    "qlite_dequantize_int4": [_P, _P, _P, _P, _L, _L, _L, _P, _I],
    "qlite_gemv_lowbit": [_P, _L, _P, _P, _P, _I, _L, _L, _L, _P, _P, _I, _I],
    "qlite_dequantize_lowbit": [_P, _P, _P, _I, _L, _L, _L, _P, _I],
    "qlite_gemv_vnni_lowbit": [_P, _L, _P, _P, _P, _I, _L, _L, _L, _P, _P, _I, _I],
    "qlite_tile_rows": [_P, _P, _L, _L, _L, _I],
    "qlite_turn_inputs": [_P, _L, _L, _P, _P, _I],
    "qlite_rmsnorm": [_P, _L, _L, _P, ctypes.c_float, _P],
    "qlite_silu_mul": [_P, _L, _L, _P],
    "qlite_decode_attention": [_P, _L, _P, _P, _P, _P, _L, _P, _L, _L, _L, _L, _L, _L, _I, _P, _P, _I],
    "qlite_argmax_bf16": [_P, _L, _L, _P, _P],
    "qlite_kv_decode": [_P, _L, _L, _L, _I, _L, _P, _L, _P, _I],
    "qlite_kv_record_bytes": [_I, _L],
    "qlite_sparse_mlp": [_P, _P, _L, _L, _P, _I],
    "qlite_decode_layers": [_P, _L, _P, _L, _L, ctypes.c_float, _P, _P, _P, _P, _L, _L, _P, _L, _L, _L, _L, _L, _L,
                            _I, _P, _I],
}
PRODUCT_ARGS = {  # each product function's weight arguments, by decode_step.h's qlite_product fields, in kind order
    "qlite_gemv_bf16": ("w", "N", "K"),
    "qlite_gemv_int8": ("w", "scales", "G", "N", "K"),
    "qlite_gemv_int4": ("w", "scales", "row_scales", "zeros", "G", "N", "K"),
    "qlite_gemv_vnni": ("w", "scales", "row_scales", "zeros", "int4", "G", "N", "K"),
    "qlite_gemv_lowbit": ("w", "scales", "row_scales", "bits", "G", "N", "K"),
    "qlite_gemv_vnni_lowbit": ("w", "scales", "row_scales", "bits", "G", "N", "K"),
}


def build(compiler: str, source: Path, flags: list[str], out_dir: Path) -> Path:
    """Compile source into out_dir (atomically: a half-written library is never left there)."""
    lib = out_dir / "libqlite_native.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        tmp_lib = Path(tmp) / lib.name
        subprocess.run([compiler, *FLAGS, *flags, str(source), "-o", str(tmp_lib)], check=True, capture_output=True,
                       timeout=300)
        os.replace(tmp_lib, lib)
    return lib


def isas_here() -> list[str]:
    """The instruction sets of ISAS whose flags this CPU has, best first."""
    return [name for name, (needs, _, _) in ISAS.items() if needs <= cpu_flags()]


def isa() -> str | None:
    """The instruction set whose kernels run here: QLITE_NATIVE_ISA (an error if the CPU lacks it), else
    the best the CPU has; None with QLITE_NATIVE=0 or neither."""
    if os.environ.get("QLITE_NATIVE", "1") == "0":
        return None
    wanted = os.environ.get("QLITE_NATIVE_ISA", "")
    if not wanted:
        return next(iter(isas_here()), None)
    if wanted not in ISAS:
        raise QliteError(f"QLITE_NATIVE_ISA={wanted}: not one of {', '.join(ISAS)}")
    missing = ISAS[wanted][0] - cpu_flags()
    if missing:
        raise QliteError(f"QLITE_NATIVE_ISA={wanted}: this CPU lacks {', '.join(sorted(missing))}")
    return wanted


def _loaded_isa() -> str | None:
    """The instruction set of the kernels library() loaded (None: none loaded)."""
    return None if library() is None else library().isa


def _avx2_kernels() -> bool:
    """Whether the loaded kernels are kernels_avx2.c's (a CPU without AVX-512 BF16, or one forced to them)."""
    return _loaded_isa() is not None and ISAS[_loaded_isa()][1] == "kernels_avx2.c"


def matmul_dtype() -> torch.dtype:
    """The dtype of prefill's matmuls on dequantized weights: bf16 beside the AVX-512 kernels (a CPU with
    bf16 arithmetic), float32 beside the AVX2 ones (there torch's bf16 matmul, without bf16 arithmetic
    in the CPU, is several times slower than its float32 one)."""
    return torch.float32 if _avx2_kernels() else torch.bfloat16


@functools.lru_cache(maxsize=None)
def library() -> ctypes.CDLL | None:
    """The kernels for isa(), built on first use; where they cannot be built (a compiler without -mavxvnni),
    the next instruction set the CPU runs, unless one was forced; None where none can (the aten kernels run)."""
    name = isa()
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if name is None or compiler is None:
        return None
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    for name in [name] if os.environ.get("QLITE_NATIVE_ISA") else isas_here():
        _, source, flags = ISAS[name]
        sources = [(CSRC / source).read_text(), *(h.read_text() for h in sorted(CSRC.glob("*.h")))]  # and its headers
        key = hashlib.sha256("\0".join([*sources, version, *FLAGS, *flags, *sorted(cpu_flags()), torch.__version__])
                             .encode())
        try:
            return load(build(compiler, CSRC / source, flags, cache_dir() / "native" / key.hexdigest()[:16]), name)
        except (OSError, subprocess.SubprocessError):
            continue
    return None


def load(path: Path, name: str) -> ctypes.CDLL | None:
    """A built kernels library for the instruction set `name`, its functions typed; None if it has none."""
    lib = ctypes.CDLL(str(path))
    if lib.qlite_gemv_abi() != 1:
        return None
    for fn, argtypes in SIGNATURES.items():
        if hasattr(lib, fn):  # qlite_gemv_vnni exists only where the CPU has AVX-512 VNNI or AVX2
            getattr(lib, fn).argtypes = argtypes
    lib.isa = name
    return lib


def float_bias(bias: torch.Tensor | None) -> torch.Tensor | None:
    """A layer's bias as the kernels take it (float32, contiguous), or None."""
    return None if bias is None else bias.detach().float().contiguous()


def _gemv_io(x: torch.Tensor, K: int, N: int) -> tuple[torch.Tensor, int, torch.Tensor, int]:
    """(x as contiguous bf16, its rows, an output for (rows of x, N), the C flag for the output's
    dtype): the output is bf16 when x is bf16, else float32."""
    xb = x.to(torch.bfloat16).contiguous()
    bf16 = x.dtype == torch.bfloat16
    y = torch.empty(*x.shape[:-1], N, dtype=torch.bfloat16 if bf16 else torch.float32)
    return xb, xb.numel() // K, y, int(bf16)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _check(t: torch.Tensor | None, dtype: torch.dtype, shape: tuple, name: str) -> None:
    """The C side trusts sizes: every buffer is checked here first, so a wrong call is an error,
    never a read or write out of bounds."""
    if t is None or t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous() or tuple(t.shape) != shape:
        got = "None" if t is None else f"{t.dtype} {tuple(t.shape)} on {t.device}{'' if t.is_contiguous() else ', strided'}"
        raise ValueError(f"native kernel: {name} must be contiguous {dtype} {shape} on the CPU, got {got}")


def _check_rule(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"native kernel: {what}")


def _check_groups(N: int, K: int, G: int, weights_per_step: int) -> None:
    _check_rule(0 < G <= MAX_GROUPS and K % G == 0 and (K // G) % weights_per_step == 0,
                f"{G} groups over {K} inputs (at most {MAX_GROUPS}, each a multiple of {weights_per_step} wide)")


class Product:
    """One layer's matrix-vector product with its weight buffers checked once, so that a call checks
    only x (a decode step makes ~100 of them; checking every buffer took half of a 10-microsecond call).
    Holds the buffers, so their pointers stay valid. fn(x, M, *weight_args, bias, y, out_bf16, threads)."""

    def __init__(self, fn: str, N: int, K: int, buffers: tuple, weight_args: tuple, bias32: torch.Tensor | None):
        if bias32 is not None:
            _check(bias32, torch.float32, (N,), "bias")
        self.N, self.K, self.buffers, self.bias32 = N, K, buffers, bias32
        self.fn_name, self.weight_args = fn, weight_args
        self.fn, self.args = getattr(library(), fn), (*weight_args, _ptr(bias32))
        self.signs = None  # a rotated format's (turn_with)

    def turn_with(self, signs: torch.Tensor) -> None:
        """Turn x first (a rotated format's codes: formats.Rotated), by signs float32 [TURN_BLOCK]."""
        _check(signs, torch.float32, (TURN_BLOCK,), "signs")
        _check_rule(self.K % TURN_BLOCK == 0, f"K {self.K} is not a multiple of {TURN_BLOCK}")
        self.signs = signs

    def turned(self, x: torch.Tensor) -> torch.Tensor:
        """x as the codes read it: bf16, turned where the format is rotated (turn.h), else as it is."""
        if self.signs is None:
            return x
        _check_rule(x.shape[-1] == self.K, f"x is {x.shape[-1]} wide, the weight {self.K}")
        xb = x.to(torch.bfloat16).contiguous()
        out = torch.empty_like(xb)
        library().qlite_turn_inputs(xb.data_ptr(), xb.numel() // self.K, self.K, self.signs.data_ptr(), out.data_ptr(),
                                    torch.get_num_threads())
        return out

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., K) -> x @ weight.T + bias: bf16 when x is bf16, else float32 (x turned first: turn_with)."""
        _check_rule(x.shape[-1] == self.K, f"x is {x.shape[-1]} wide, the weight {self.K}")
        xb, M, y, out_bf16 = _gemv_io(x, self.K, self.N)
        xb = self.turned(xb)
        self.fn(xb.data_ptr(), M, *self.args, y.data_ptr(), out_bf16, torch.get_num_threads())
        return y


def bf16_product(weight: torch.Tensor, bias32: torch.Tensor | None) -> Product:
    """For a bf16 weight [N, K]; bias32 from float_bias."""
    N, K = weight.shape
    _check(weight, torch.bfloat16, (N, K), "weight")
    _check_rule(K % 64 == 0, f"K {K} is not a multiple of 64")
    return Product("qlite_gemv_bf16", N, K, (weight,), (weight.data_ptr(), N, K), bias32)


def int8_product(qweight, scales, bias32) -> Product:
    """For int8 codes [N, K] with fp16 scales [N, groups]."""
    N, K = qweight.shape
    _check_int8(qweight, scales)
    return Product("qlite_gemv_int8", N, K, (qweight, scales),
                   (qweight.data_ptr(), scales.data_ptr(), scales.shape[1], N, K), bias32)


def int4_product(qweight, scales, zeros, bias32=None, row_scales=None) -> Product:
    """For packed int4 codes [N, K/2] with fp16 scales and uint8 zeros [N, groups]; int4k: uint8 scale
    codes under row_scales fp16 [N, 1] (each group's scale fp16(row scale x code))."""
    N, K = qweight.shape[0], 2 * qweight.shape[1]
    _check_int4(qweight, scales, zeros, row_scales)
    return Product("qlite_gemv_int4", N, K, (qweight, scales, zeros, row_scales),
                   (qweight.data_ptr(), scales.data_ptr(), _ptr(row_scales), zeros.data_ptr(), scales.shape[1], N, K),
                   bias32)


def lowbit_product(qweight, scales, row_scales, bits: int, bias32=None) -> Product:
    """For int3k / int2k codes [N, bits K / 8] (formats.py's layout, 128 inputs a block), uint8 scale codes and zero
    points [N, groups] and row_scales fp16 [N, 1]; bf16 activations (fp32 on AVX2)."""
    N, K, G = qweight.shape[0], 8 * qweight.shape[1] // bits, scales.shape[-1]
    _check_lowbit(qweight, scales, row_scales, bits)
    return Product("qlite_gemv_lowbit", N, K, (qweight, scales, row_scales),
                   (qweight.data_ptr(), scales.data_ptr(), row_scales.data_ptr(), bits, G, N, K), bias32)


def dequantize_lowbit(qweight, scales, row_scales, bits: int, out: torch.Tensor | None = None) -> torch.Tensor:
    N, K = qweight.shape[0], 8 * qweight.shape[1] // bits
    _check_lowbit(qweight, scales, row_scales, bits)
    out = _bf16_out(out, N, K)
    library().qlite_dequantize_lowbit(qweight.data_ptr(), scales.data_ptr(), row_scales.data_ptr(), bits,
                                      scales.shape[1], N, K, out.data_ptr(), torch.get_num_threads())
    return out


def _check_lowbit(qweight, scales, row_scales, bits: int) -> None:
    _check_rule(bits in (2, 3), f"bits {bits}: int3k or int2k")
    N, K = qweight.shape[0], 8 * qweight.shape[1] // bits
    _check(qweight, torch.uint8, (N, K * bits // 8), "qweight")
    _check(scales, torch.uint8, (N, scales.shape[-1]), "scales")
    _check(row_scales, torch.float16, (N, 1), "row_scales")
    G = scales.shape[1]
    _check_rule(K % CHUNK == 0 and 0 < G <= LOWBIT_MAX_GROUPS and K % G == 0 and (K // G == 16 or (K // G) % 32 == 0),
                f"{G} groups over {K} inputs (K a multiple of {CHUNK}, at most {LOWBIT_MAX_GROUPS} groups of 16 or a "
                f"multiple of 32)")


def lowbit_lanes_fit(in_features: int, group_size: int) -> bool:
    """Whether vnni_lowbit_product takes a layer here: integer-activation kernels (every file that has them has it),
    groups that divide CHUNK (16-128)."""
    return vnni_ready() and in_features % CHUNK == 0 and CHUNK % group_size == 0


def tile_lowbit(qweight: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int3k / int2k codes [N, bits K / 8] and scale bytes [N, G] as stored -> copies in lanes (lanes.h): blocks of
    lanes_rows() rows, the codes a 4-byte word of each row side by side, the scale bytes a group of each row side by
    side. Same shapes, same bytes, another order."""
    _check_rule(vnni_ready(), "no integer-activation products for int3k / int2k on this CPU")
    codes, scale_bytes = torch.empty_like(qweight), torch.empty_like(scales)
    for src, dst, unit in ((qweight, codes, 4), (scales, scale_bytes, 1)):
        _check_rule(src.dtype == torch.uint8 and src.dim() == 2 and src.is_contiguous() and src.shape[1] % unit == 0,
                    f"uint8 rows of whole {unit}-byte units, contiguous: {src.dtype} {tuple(src.shape)}")
        library().qlite_tile_rows(src.data_ptr(), dst.data_ptr(), src.shape[0], src.shape[1], unit,
                                  torch.get_num_threads())
    return codes, scale_bytes


def vnni_lowbit_product(qweight, scales, row_scales, bits: int, bias32=None) -> Product:
    """lowbit_product's with x quantized first to int8 in k order, absmax / 127 per row and group (span: the group,
    at most CHUNK inputs), and integer dot products: not exact in x (lanes.h). Codes and scale bytes tiled
    (tile_lowbit); groups of 16, 32, 64 or 128."""
    N, K, G = qweight.shape[0], 8 * qweight.shape[1] // bits, scales.shape[-1]
    _check_lowbit(qweight, scales, row_scales, bits)
    _check_rule(lowbit_lanes_fit(K, K // G),
                f"{G} groups over {K} inputs: groups of 16, 32, 64 or 128 (or no integer-activation products)")
    return Product("qlite_gemv_vnni_lowbit", N, K, (qweight, scales, row_scales),
                   (qweight.data_ptr(), scales.data_ptr(), row_scales.data_ptr(), bits, G, N, K), bias32)


def gemv_bf16(x: torch.Tensor, weight: torch.Tensor, bias32: torch.Tensor | None) -> torch.Tensor:
    """x (..., K) -> x @ weight.T + bias for a bf16 weight [N, K] (bf16_product, once)."""
    return bf16_product(weight, bias32)(x)


def gemv_int8(x: torch.Tensor, qweight, scales, bias32) -> torch.Tensor:
    return int8_product(qweight, scales, bias32)(x)


def gemv_int4(x: torch.Tensor, qweight, scales, zeros, bias32, row_scales=None) -> torch.Tensor:
    return int4_product(qweight, scales, zeros, bias32, row_scales)(x)


def _check_int8(qweight, scales) -> None:
    N, K = qweight.shape
    _check(qweight, torch.int8, (N, K), "qweight")
    _check(scales, torch.float16, (N, scales.shape[-1]), "scales")
    _check_groups(N, K, scales.shape[-1], 32)


def _check_int4(qweight, scales, zeros, row_scales, weights_per_step: int = 64) -> None:
    N, K = qweight.shape[0], 2 * qweight.shape[1]
    _check(qweight, torch.uint8, (N, K // 2), "qweight")
    _check(scales, torch.float16 if row_scales is None else torch.uint8, (N, scales.shape[-1]), "scales")
    if row_scales is not None:
        _check(row_scales, torch.float16, (N, 1), "row_scales")
    _check(zeros, torch.uint8, (N, scales.shape[-1]), "zeros")
    _check_groups(N, K, scales.shape[-1], weights_per_step)


def vnni_ready() -> bool:
    """Whether the integer-activation kernels (AVX-512 VNNI, or AVX2's vpmaddubsw) were built for this CPU."""
    return library() is not None and library().qlite_vnni_abi() == 1


def lanes_rows() -> int:
    """The weight rows of a block of codes in lanes (lanes.h: 16 on AVX-512, 8 on AVX2), the layout of
    tile_codes; int4 weights meet int8 activations (absmax / 127 per row and span: the group, at most CHUNK
    inputs), int8 weights int16 ones (absmax / 32767 per row and span), in one product at every row count, each
    row's result the same at any row count and on either instruction set."""
    _check_rule(vnni_ready(), "no integer-activation kernels")
    return library().qlite_int4_lanes()


def vnni_fits(in_features: int, group_size: int) -> bool:
    """Whether gemv_vnni takes a layer: the width whole CHUNKs, groups whole CHUNKs or 32 or 64 wide."""
    return (in_features % CHUNK == 0 and (group_size % CHUNK == 0 or group_size in (32, 64))
            and in_features // group_size <= MAX_GROUPS)


def tile_codes(qweight: torch.Tensor) -> torch.Tensor:
    """int8 codes [N, K] or packed int4 codes (uint8) [N, K/2], row-major as stored -> a copy laid out as
    the integer-activation products take them, in lanes (lanes.h): blocks of lanes_rows() rows, [K / 8][rows]
    [4 bytes] (int4) or [K / 2][rows][2 bytes] (int8), so that a block is one sequential stream. Same shape, same
    bytes, another order."""
    int4 = qweight.dtype == torch.uint8
    _check(qweight, torch.uint8 if int4 else torch.int8, (qweight.shape[0], qweight.shape[-1]), "qweight")
    K = qweight.shape[1] * (2 if int4 else 1)
    _check_rule(vnni_ready() and K % CHUNK == 0, f"K {K} is not a multiple of {CHUNK} (or no integer-activation kernels)")
    out = torch.empty_like(qweight)
    library().qlite_tile_codes(qweight.data_ptr(), out.data_ptr(), qweight.shape[0], K, int(int4), torch.get_num_threads())
    return out


def vnni_product(qweight, scales, zeros, bias32=None, row_scales=None) -> Product:
    """int8_product / int4_product (zeros None for int8) with x quantized first per row and span of inputs (int16
    for int8 weights, int8 for int4: lanes_rows) and integer dot products: not exact in x (lanes.h). Codes tiled
    (tile_codes)."""
    int4 = zeros is not None
    N, K = qweight.shape[0], qweight.shape[1] * (2 if int4 else 1)
    _check_rule(int4 or row_scales is None, "row_scales without zeros (int4k is int4)")
    _check_int4(qweight, scales, zeros, row_scales, 32) if int4 else _check_int8(qweight, scales)
    _check_rule(vnni_ready() and vnni_fits(K, K // scales.shape[1]), f"K {K} in {scales.shape[1]} groups, "
                f"not whole chunks of {CHUNK} or groups of 32 or 64 (or no integer-activation kernels)")
    return Product("qlite_gemv_vnni", N, K, (qweight, scales, zeros, row_scales),
                   (qweight.data_ptr(), scales.data_ptr(), _ptr(row_scales), _ptr(zeros), int(int4), scales.shape[1], N,
                    K), bias32)


def gemv_vnni(x: torch.Tensor, qweight, scales, zeros, bias32, row_scales=None) -> torch.Tensor:
    """vnni_product's, once, for the codes as stored (tiled here)."""
    return vnni_product(tile_codes(qweight), scales, zeros, bias32, row_scales)(x)


def _bf16_out(out: torch.Tensor | None, N: int, K: int) -> torch.Tensor:
    if out is None:
        return torch.empty(N, K, dtype=torch.bfloat16)
    _check(out, torch.bfloat16, (N, K), "out")
    return out


def dequantize_int8(qweight, scales, out: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 weights [N, K] (codes as stored), into `out` if given."""
    N, K = qweight.shape
    _check_int8(qweight, scales)
    out = _bf16_out(out, N, K)
    library().qlite_dequantize_int8(qweight.data_ptr(), scales.data_ptr(), scales.shape[1], N, K,
                                    out.data_ptr(), torch.get_num_threads())
    return out


def dequantize_int4(qweight, scales, zeros, row_scales=None, out: torch.Tensor | None = None) -> torch.Tensor:
    N, K = qweight.shape[0], 2 * qweight.shape[1]
    _check_int4(qweight, scales, zeros, row_scales, 32)  # 32 weights a step
    out = _bf16_out(out, N, K)
    library().qlite_dequantize_int4(qweight.data_ptr(), scales.data_ptr(), _ptr(row_scales), zeros.data_ptr(),
                                    scales.shape[1], N, K, out.data_ptr(), torch.get_num_threads())
    return out


def bf16_ready(x: torch.Tensor) -> bool:
    """Whether the native bf16 ops can take x (bf16, on the CPU, rows a multiple of 32 wide)."""
    return x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.shape[-1] % 32 == 0 and library() is not None


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of bf16 rows with a bf16 weight, rounded as torch rounds it (see model.RMSNorm)."""
    x = x.contiguous()
    _check(x, torch.bfloat16, tuple(x.shape), "x")
    _check(weight, torch.bfloat16, (x.shape[-1],), "weight")
    _check_rule(x.shape[-1] % 16 == 0, f"rows {x.shape[-1]} wide, not a multiple of 16")
    out = torch.empty_like(x)
    library().qlite_rmsnorm(x.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], weight.data_ptr(), eps, out.data_ptr())
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for bf16 rows [gate | up]."""
    gate_up = gate_up.contiguous()
    n = gate_up.shape[-1] // 2
    _check(gate_up, torch.bfloat16, tuple(gate_up.shape), "gate_up")
    _check_rule(gate_up.shape[-1] % 32 == 0, f"rows {gate_up.shape[-1]} wide, not a multiple of 32")
    out = torch.empty(*gate_up.shape[:-1], n, dtype=gate_up.dtype)
    library().qlite_silu_mul(gate_up.data_ptr(), gate_up.numel() // (2 * n), n, out.data_ptr())
    return out


def checked_starts(starts: torch.Tensor | None, B: int, pos: int) -> torch.Tensor | None:
    """Where each of B rows' keys start (int64, contiguous, each in 0..pos), as the attention kernel takes them."""
    if starts is None:
        return None
    starts = starts.contiguous()
    _check(starts, torch.int64, (B,), "starts")
    _check_rule(bool(((starts >= 0) & (starts <= pos)).all()), f"starts outside 0..{pos}")
    return starts


def kv_record_bytes(bits: int, head_dim: int) -> int:
    """The bytes of one (head, token) record of a KV cache of `bits` (attention.h's layout, which
    kv_quant.py writes too)."""
    return library().qlite_kv_record_bytes(bits, head_dim)


def cache_ready(cache: torch.Tensor, bits: int) -> bool:
    """Whether decode attention takes a cache of these records (bf16 values, or kv_quant's uint8 records)."""
    return cache.is_cpu and cache.dtype == (torch.bfloat16 if bits == 16 else torch.uint8) and library() is not None


def decode_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache_k: torch.Tensor,
                     cache_v: torch.Tensor, n_head: int, pos: int, starts: torch.Tensor | None = None,
                     bits: int = 16, k_offset: torch.Tensor | None = None, one_sequence: bool = False) -> torch.Tensor:
    """One new token of each of B sequences: rotary q and k (cos/sin float32 [B, head_dim]), k and v
    stored at `pos` of the row's caches ([B, n_kv, capacity, record]: bf16 values for bits 16, else
    kv_quant's uint8 records of the keys less k_offset (float32 [n_kv, head_dim]) and the values; each
    row contiguous), attention over the row's positions starts[b]..pos (int64 [B]; None: from 0).
    one_sequence: the B rows are B new tokens of one sequence at pos..pos+B-1, whose caches are [1, n_kv,
    capacity, record]: every token's keys stored, then each attends up to its own position, exactly as B
    one-token steps in turn (a prefill whose every number is the steps'). qkv: bf16 [B, q|k|v]. Returns
    bf16 [B, n_head * head_dim]."""
    B = qkv.shape[0]
    rows, n_kv, capacity, _ = cache_k.shape
    _check_rule(bits in (16, 8, 4) and n_head > 0 and n_kv > 0, f"{bits}-bit cache, {n_head} heads over {n_kv}")
    hd = qkv.shape[-1] // (n_head + 2 * n_kv)
    rec = kv_record_bytes(bits, hd) // cache_k.element_size()
    qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
    for cache, name in ((cache_k, "cache_k"), (cache_v, "cache_v")):
        _check_rule(cache_ready(cache, bits) and cache.shape == (1 if one_sequence else B, n_kv, capacity, rec)
                    and cache.stride()[1:] == (capacity * rec, rec, 1) and cache.stride(0) == cache_k.stride(0),
                    f"{name} {tuple(cache.shape)} {cache.dtype}: want {bits}-bit records of [{n_kv}, {capacity}, {rec}]")
    _check(qkv, torch.bfloat16, (B, (n_head + 2 * n_kv) * hd), "qkv")
    _check_rule(n_head % n_kv == 0 and hd % 32 == 0, f"{n_head} heads over {n_kv} of {hd}")
    for t, name in ((cos, "cos"), (sin, "sin")):
        _check(t, torch.float32, (B, hd), name)
    last = pos + (B - 1 if one_sequence else 0)
    _check_rule(0 <= pos and last < capacity, f"positions {pos}..{last} outside a cache of {capacity}")
    if k_offset is not None:
        _check(k_offset, torch.float32, (n_kv, hd), "k_offset")
    starts = checked_starts(starts, B, pos)
    out = torch.empty(B, n_head * hd, dtype=torch.bfloat16)
    library().qlite_decode_attention(qkv.data_ptr(), B, cos.data_ptr(), sin.data_ptr(), cache_k.data_ptr(),
                                     cache_v.data_ptr(), 0 if one_sequence else cache_k.stride(0) * cache_k.element_size(),
                                     _ptr(starts), n_head, n_kv, hd, capacity,
                                     pos, 1 if one_sequence else 0, bits, _ptr(k_offset), out.data_ptr(),
                                     torch.get_num_threads())
    return out


def kv_decode(records: torch.Tensor, bits: int, head_dim: int, offset: torch.Tensor | None = None) -> torch.Tensor | None:
    """A quantized cache's records (B, n_kv, T, record) uint8 -> bf16 values (B, n_kv, T, head_dim), plus
    offset (float32 [n_kv, head_dim]) where given; None where the records' layout is not one the
    kernel walks (each head's T records contiguous, heads and rows evenly apart) or no library."""
    B, n_kv, T, rec = records.shape
    st = records.stride()
    if (library() is None or records.dtype != torch.uint8 or not records.is_cpu or bits not in (8, 4) or head_dim % 32
            or rec != kv_record_bytes(bits, head_dim) or st[3] != 1 or st[2] != rec
            or (B > 1 and st[0] != n_kv * st[1])):
        return None
    if offset is not None:
        _check(offset, torch.float32, (n_kv, head_dim), "offset")
    out = torch.empty(B, n_kv, T, head_dim, dtype=torch.bfloat16)
    library().qlite_kv_decode(records.data_ptr(), B * n_kv, T, st[1], bits, head_dim, _ptr(offset), n_kv,
                              out.data_ptr(), torch.get_num_threads())
    return out


def argmax_ready(logits: torch.Tensor) -> bool:
    """Whether argmax takes these logits (bf16 rows on the CPU, a multiple of 16 wide)."""
    return (logits.dim() == 2 and logits.dtype == torch.bfloat16 and logits.is_cpu and logits.shape[-1] % 16 == 0
            and library() is not None)


def argmax(logits: torch.Tensor) -> tuple[list[int], list[bool]]:
    """Per row of bf16 logits (B, V): the index of the largest (the first of equals, as torch.argmax)
    and whether all are finite, in one pass without a float32 copy."""
    logits = logits.contiguous()
    B, V = logits.shape
    _check(logits, torch.bfloat16, (B, V), "logits")
    _check_rule(V % 16 == 0, f"rows {V} wide, not a multiple of 16")
    top, finite = torch.empty(B, dtype=torch.int64), torch.empty(B, dtype=torch.uint8)
    library().qlite_argmax_bf16(logits.data_ptr(), B, V, top.data_ptr(), finite.data_ptr())
    return top.tolist(), finite.bool().tolist()
