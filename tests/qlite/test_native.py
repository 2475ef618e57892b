"""qlite's native CPU kernels (native.py) against torch computing the same thing, once for each
instruction set this CPU runs (AVX-512 and AVX2 here; AVX2 alone on older CPUs); skipped where no
library can be built (no C compiler, or a CPU with neither)."""
import math
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from qlite import native
from qlite.errors import QliteError
from qlite.loader import load_model
from qlite.formats import Int2K, Int3K, Int4, Int4K, Int8
from qlite.decoder.ops import apply_rope
from qlite.qlinear import QuantLinear
from tiny_models import NATIVE_WIDTHS, PRIME_PROMPT, make_checkpoint

pytestmark = pytest.mark.skipif(native.library() is None, reason="native kernels unavailable here")


@pytest.fixture(autouse=True)
def isa(native_isa):
    """Every test here runs with each instruction set's kernels this CPU runs."""
    return native_isa


@pytest.mark.parametrize("flags, forced, want", [
    ({"avx512_bf16", "avx512bw", "avx512vl", "avx2", "fma", "f16c"}, "", "avx512"),
    ({"avx512_bf16", "avx512bw", "avx512vl", "avx2", "fma", "f16c"}, "avx2", "avx2"),
    ({"avx2", "fma", "f16c"}, "", "avx2"),  # an AVX2 laptop
    ({"avx2", "fma", "f16c", "avx_vnni"}, "", "avxvnni"),  # an Intel laptop from Alder Lake on
    ({"avx512_bf16", "avx512bw", "avx512vl", "avx2", "fma", "f16c", "avx_vnni"}, "", "avx512"),
    ({"avx2", "fma", "f16c", "avx_vnni"}, "avx2", "avx2"),
    ({"avx2", "fma", "f16c"}, "avxvnni", "this CPU lacks avx_vnni"),
    ({"avx2", "f16c"}, "", None),  # no FMA: torch's kernels
    ({"avx2", "fma", "f16c"}, "avx512", "this CPU lacks avx512_bf16, avx512bw, avx512vl"),
    ({"avx2", "fma", "f16c"}, "sse", "not one of avx512, avxvnni, avx2"),
])
def test_dispatch_takes_the_best_isa_the_cpu_has_or_the_forced_one(monkeypatch, flags, forced, want):
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setenv("QLITE_NATIVE_ISA", forced)
    if want is None or want in native.ISAS:
        assert native.isa() == want
    else:
        with pytest.raises(QliteError, match=f"QLITE_NATIVE_ISA={forced}: {want}"):
            native.isa()
    monkeypatch.setenv("QLITE_NATIVE", "0")
    assert native.isa() is None


@pytest.mark.parametrize("bf16_cpu, kernels, want", [(True, True, torch.bfloat16), (False, True, torch.bfloat16),
                                                      (True, False, torch.bfloat16), (False, False, torch.float32)])
def test_auto_dtype_is_bf16_where_the_cpu_or_the_native_kernels_take_it(monkeypatch, bf16_cpu, kernels, want):
    """An AVX2 CPU without bf16 arithmetic still runs bf16 activations through qlite's kernels."""
    from qlite import loader
    monkeypatch.setattr(loader, "cpu_has_bf16", lambda: bf16_cpu)
    monkeypatch.setattr(loader, "native", SimpleNamespace(library=lambda: object() if kernels else None))
    assert loader.resolve_dtype("auto", torch.device("cpu")) == want


@pytest.mark.parametrize("built", ["avx2", "avxvnni"])
def test_the_avx2_kernels_use_no_avx512_instruction(monkeypatch, built):
    """What runs on an AVX2-only CPU: the library built for avx2 touches no zmm register and has no VNNI
    instruction; the one built for avxvnni takes AVX-VNNI's (VEX) multiply-adds."""
    objdump = shutil.which("objdump")
    if not native.ISAS[built][0] <= native.cpu_flags() or objdump is None:
        pytest.skip(f"needs a CPU with {built} and objdump")
    monkeypatch.setenv("QLITE_NATIVE_ISA", built)
    native.library.cache_clear()
    path = native.library()._name
    code = subprocess.run([objdump, "-d", path], capture_output=True, text=True, check=True).stdout
    assert "vfmadd" in code and "ymm" in code and "zmm" not in code
    assert ("{vex} vpdpbusd" in code and "{vex} vpdpwssd" in code) == (built == "avxvnni")
    assert ("vpdpbusd" in code) == (built == "avxvnni")


def gen(seed):
    return torch.Generator().manual_seed(seed)


def rel_err(got, want):
    return ((got.float() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("n", [1, 37, 256])  # a partial block of 4 rows, and none
@pytest.mark.parametrize("bias", [True, False])
def test_gemv_bf16_matches_float32_matmul(rows, n, bias):
    w = torch.randn(n, 192, generator=gen(0)).bfloat16()
    x = torch.randn(rows, 192, generator=gen(1))  # float32 in, float32 out
    b = torch.randn(n, generator=gen(2)) if bias else None
    want = F.linear(x.bfloat16().float(), w.float(), b)  # the kernel reads x in bf16
    assert rel_err(native.gemv_bf16(x, w, b), want) < 1e-5


@pytest.mark.parametrize("group_size", [None, 32, 64])
@pytest.mark.parametrize("rows, n", [(1, 37), (5, 256)])
def test_gemv_int8_matches_dequantized_matmul(group_size, rows, n):
    fmt = Int8(group_size)
    stored = fmt.quantize(torch.randn(n, 256, generator=gen(0)))
    q, s = stored["qweight"], stored["scales"]
    x = torch.randn(rows, 256, generator=gen(1))
    b = torch.randn(n, generator=gen(2))
    want = F.linear(x.bfloat16().float(), fmt.dequantize(stored, 256), b)
    assert rel_err(native.gemv_int8(x, q, s, b), want) < 1e-5


@pytest.mark.parametrize("group_size, symmetric", [(64, False), (128, True), (256, False)])
@pytest.mark.parametrize("rows, n", [(1, 37), (8, 256)])
def test_gemv_int4_matches_dequantized_matmul(group_size, symmetric, rows, n):
    fmt = Int4(group_size, symmetric)
    stored = fmt.quantize(torch.randn(n, 256, generator=gen(0)))
    q, s, z = stored["qweight"], stored["scales"], stored["zeros"]
    x = torch.randn(rows, 256, generator=gen(1)) * 3
    want = F.linear(x.bfloat16().float(), fmt.dequantize(stored, 256))
    assert rel_err(native.gemv_int4(x, q, s, z, None), want) < 1e-5


@pytest.mark.parametrize("fmt", [Int4(128), Int4(256, symmetric=True), Int4(64), Int4(32), Int8(None), Int8(128),
                                 Int8(64), Int8(32)], ids=str)
@pytest.mark.parametrize("rows, n", [(1, 37), (3, 40), (6, 256), (16, 40), (37, 8)])  # partial blocks of weight /
def test_gemv_vnni_is_the_product_with_integer_activations(fmt, rows, n):                # x rows; every pass width
    if not native.vnni_ready():
        pytest.skip("no integer-activation kernels (AVX-512 without VNNI)")
    K = 384
    stored = fmt.quantize(torch.randn(n, K, generator=gen(0)))
    x = torch.randn(rows, K, generator=gen(1))
    x[:, 5] *= 100  # an outlier channel: only its own block's scale widens
    x = x.bfloat16().float()  # what the kernel reads; float32 in, so float32 out (not rounded to bf16)
    b = torch.randn(n, generator=gen(2))
    w = fmt.dequantize(stored, K)
    int4 = isinstance(fmt, Int4)
    got = native.gemv_vnni(x, stored["qweight"], stored["scales"], stored.get("zeros"), b)
    span = min(fmt.group_size or K, native.CHUNK)
    image = span_activations(x, span, 127 if int4 else 32767)
    assert rel_err(got, F.linear(image, w, b)) < 2e-5  # its numerics, to fp32 rounding
    exact = F.linear(x.float(), w, b)
    # measured 1-3e-2 (int8 x per span; the outlier's span worst), 5e-5-1.2e-4 (int16 x per span); int8 weights'
    # own error is ~4e-3
    assert rel_err(got, exact) < (5e-2 if int4 else 3e-4)
    rows_alone = torch.cat([native.gemv_vnni(x[i:i + 1], stored["qweight"], stored["scales"], stored.get("zeros"), b)
                            for i in range(rows)])
    assert torch.equal(got, rows_alone)  # a row's result never depends on the rows batched with it


def span_activations(x: torch.Tensor, span: int, top: int = 127) -> torch.Tensor:
    """The image of bf16 rows x (M, K) that a product in lanes multiplies, computed independently: integers, absmax
    / top per row and span of inputs (int8 for int4 weights; int16, top 32767, for int8 ones in lanes)."""
    M, K = x.shape
    blocks = x.float().view(M, K // span, span)
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, torch.full_like(amax, top) / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inverse) * (amax / top)).reshape(M, K)


@pytest.mark.parametrize("fmt", [Int4(128), Int4(256, symmetric=True), Int4(64), Int4(32), Int4K(32)], ids=str)
@pytest.mark.parametrize("rows, n, K", [(17, 40, 512), (37, 8, 256), (50, 130, 768)])  # partial tiles of rows and
def test_int4_product_at_prefill_rows_is_the_product_with_integer_activations(fmt, rows, n, K):  # weight rows;
    if not native.vnni_ready():                                                                 # K past one block
        pytest.skip("no integer-activation kernels (AVX-512 without VNNI)")
    stored = fmt.quantize(torch.randn(n, K, generator=gen(0)))
    x = torch.randn(rows, K, generator=gen(1))
    x[:, 5] *= 100  # an outlier channel: its span's scale widens
    x = x.bfloat16().float()
    b = torch.randn(n, generator=gen(2))
    w = fmt.dequantize(stored, K)
    q = native.tile_codes(stored["qweight"])  # the layout it takes
    got = native.vnni_product(q, stored["scales"], stored["zeros"], b, stored.get("row_scales"))(x)
    span = min(fmt.group_size, native.CHUNK)
    assert rel_err(got, F.linear(span_activations(x, span), w, b)) < 2e-5  # its numerics, to fp32 rounding
    assert rel_err(got, F.linear(x, w, b)) < 5e-2  # measured 1-3e-2: the outlier's span (gemv_vnni's blocks of 8: 3-8e-3)
    rows_alone = torch.cat([native.vnni_product(q, stored["scales"], stored["zeros"], b,
                                                stored.get("row_scales"))(x[i:i + 1]) for i in range(rows)])
    assert torch.equal(got, rows_alone)  # a row's result never depends on the rows batched with it


@pytest.mark.parametrize("fmt", [Int4(128), Int4(32), Int4K(64), Int8(None), Int8(32), Int3K(32), Int3K(16), Int2K(16)],
                         ids=str)
def test_both_instruction_sets_give_the_same_bits(fmt, isa, monkeypatch):
    """lanes.h: the same integers and float steps on AVX-512 (16 weight rows a vector) and AVX2 (8; with AVX-VNNI's
    multiply-adds or without), so a checkpoint decodes to the same bits on any (at 1-37 rows, a weight of partial
    blocks on both)."""
    if isa != "avx512":
        pytest.skip("compared once, from the AVX-512 run (a CPU that runs both)")
    K, n = 768, 40
    stored = fmt.quantize(torch.randn(n, K, generator=gen(0)))
    x = torch.randn(37, K, generator=gen(1))
    x[:, 5] *= 100
    x = x.bfloat16().float()  # float32 in, so float32 out: no rounding to bf16 hides a difference
    b = torch.randn(n, generator=gen(2))

    def products():  # tiled for the kernels loaded (16 or 8 rows a block)
        if isinstance(fmt, (Int3K, Int2K)):
            product = native.vnni_lowbit_product(*native.tile_lowbit(stored["qweight"], stored["scales"]),
                                                 stored["row_scales"], fmt.bits, b)
        else:
            product = native.vnni_product(native.tile_codes(stored["qweight"]), stored["scales"], stored.get("zeros"),
                                          b, stored.get("row_scales"))
        return [product(x[:rows]) for rows in (1, 3, 8, 37)]
    on_avx512 = products()
    others = [name for name in native.isas_here() if name != "avx512"]
    assert others  # a CPU with AVX-512 BF16 has AVX2
    for other in others:
        monkeypatch.setenv("QLITE_NATIVE_ISA", other)
        native.library.cache_clear()
        assert native.lanes_rows() == 8
        for got, want in zip(products(), on_avx512):
            assert torch.equal(got, want), other


def test_int4_product_takes_more_rows_than_one_block():
    if not native.vnni_ready():
        pytest.skip("no integer-activation kernels (AVX-512 without VNNI)")
    fmt, K = Int4(128), 256
    stored = fmt.quantize(torch.randn(24, K, generator=gen(0)))
    x = torch.randn(1100, K, generator=gen(1)).bfloat16()  # blocks of 256 rows (lanes.h's LMB): four and a part
    product = native.vnni_product(native.tile_codes(stored["qweight"]), stored["scales"], stored["zeros"])
    got = product(x)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got[600:700], product(x[600:700]))
    assert rel_err(got.float(), F.linear(span_activations(x, 128), fmt.dequantize(stored, K))) < 1e-2  # bf16 out


@pytest.mark.parametrize("fmt", [Int4(128), Int8(None)], ids=str)
def test_a_prefill_takes_the_integer_products(isa, fmt):
    """A prefill's rows: int4 weights go through the integer-activation product at every row count (both
    ISAs); int8 weights through the matrix-vector product beside AVX2's float32 matmuls (faster at any row
    count; each row exactly as when decoded alone), dequantized for a bf16 matmul beside AVX-512's."""
    from qlite.kernels import VnniInt4, VnniInt8
    if not native.vnni_ready():
        pytest.skip("no integer-activation kernels (AVX-512 without VNNI)")
    layer = QuantLinear(256, 40, True, fmt)
    for name, t in fmt.quantize(torch.randn(40, 256, generator=gen(0))).items():
        setattr(layer, name, t)
    layer.bias = torch.nn.Parameter(torch.randn(40, generator=gen(1)).bfloat16())
    kernel = (VnniInt4 if isinstance(fmt, Int4) else VnniInt8)(layer)
    x = torch.randn(1, 40, 256, generator=gen(2)).bfloat16()
    integer = kernel.product(x)
    assert torch.equal(integer[0, 7], kernel.product(x[0, 7:8])[0])
    assert torch.equal(kernel(x), integer)  # 40 rows too: one product at every row count, int8 as int4
    assert kernel.exact_rows == sys.maxsize


def test_dequantize_to_bf16_is_exact():
    w = torch.randn(42, 256, generator=gen(0))  # a last block of 2 rows
    int8 = Int8(64).quantize(w)
    assert torch.equal(native.dequantize_int8(*int8.values()), Int8(64).dequantize(int8, 256).bfloat16())
    int4 = Int4(64).quantize(w)
    assert torch.equal(native.dequantize_int4(*int4.values()), Int4(64).dequantize(int4, 256).bfloat16())


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("rows, n", [(1, 37), (5, 64)])
def test_int4k_products_are_the_int4_products_on_its_coded_scales(group_size, rows, n):
    """int4k's kernels make each group's fp16 scale from its code and row scale as formats.coded_scale
    does: every product is bitwise the int4 one given those fp16 scales (each tested above)."""
    fmt, K = Int4K(group_size), 384
    w = torch.randn(n, K, generator=gen(0)) * torch.logspace(-3, 0, n)[:, None]  # rows of very different ranges
    stored = fmt.quantize(w)
    q, codes, z, d = stored["qweight"], stored["scales"], stored["zeros"], stored["row_scales"]
    fp16 = fmt.group_scales(stored).half()
    x = torch.randn(rows, K, generator=gen(1)).bfloat16()
    b = torch.randn(n, generator=gen(2))
    assert torch.equal(native.dequantize_int4(q, codes, z, d), native.dequantize_int4(q, fp16, z))
    assert torch.equal(native.dequantize_int4(q, codes, z, d), fmt.dequantize(stored, K).bfloat16())
    if group_size % 64 == 0:
        assert torch.equal(native.gemv_int4(x, q, codes, z, b, d), native.gemv_int4(x, q, fp16, z, b))
    if native.vnni_ready():
        assert torch.equal(native.gemv_vnni(x, q, codes, z, b, d), native.gemv_vnni(x, q, fp16, z, b))
    with pytest.raises(ValueError, match="scales must be contiguous torch.uint8"):
        native.gemv_int4(x, q, fp16, z, b, d)
    with pytest.raises(ValueError, match="row_scales must be"):
        native.dequantize_int4(q, codes, z, d[:-1])


@pytest.mark.parametrize("fmt", [Int3K(16), Int3K(32), Int3K(128), Int2K(16), Int2K(64)], ids=str)
@pytest.mark.parametrize("rows, n", [(1, 37), (5, 64), (8, 9)])  # partial blocks of 4 weight rows, and none
def test_lowbit_products_match_the_dequantized_matmul(fmt, rows, n):
    """int3k / int2k: the product with bf16 activations is the matmul with the dequantized weight (up to the
    order of fp32 sums), and dequantization to bf16 is exact; every group size, rows of very different ranges."""
    K = 384  # three blocks of 128
    w = torch.randn(n, K, generator=gen(0)) * torch.logspace(-3, 0, n)[:, None]
    stored = fmt.quantize(w)
    q, scales, d = stored["qweight"], stored["scales"], stored["row_scales"]
    x = torch.randn(rows, K, generator=gen(1)) * 3
    b = torch.randn(n, generator=gen(2))
    want = F.linear(x.bfloat16().float(), fmt.dequantize(stored, K), b)
    assert rel_err(native.lowbit_product(q, scales, d, fmt.bits, b)(x), want) < 1e-5
    assert rel_err(native.lowbit_product(q, scales, d, fmt.bits, b)(x.bfloat16()).float(), want) < 1e-2
    assert torch.equal(native.dequantize_lowbit(q, scales, d, fmt.bits), fmt.dequantize(stored, K).bfloat16())
    with pytest.raises(ValueError, match="row_scales must be"):
        native.lowbit_product(q, scales, d[:-1], fmt.bits)
    with pytest.raises(ValueError, match="qweight must be"):
        native.lowbit_product(q[:, :-1], scales, d, fmt.bits)


@pytest.mark.parametrize("fmt", [Int3K(16), Int3K(32), Int3K(128), Int2K(16), Int2K(64)], ids=str)
@pytest.mark.parametrize("rows, n, K", [(1, 37, 384), (3, 40, 256), (17, 8, 512), (6, 130, 768)])  # partial blocks of
def test_lowbit_products_in_lanes_are_the_products_with_integer_activations(fmt, rows, n, K):  # weight rows, and tiles
    """int3k / int2k in lanes (lanes.h): the matmul of the dequantized weight with the activations' int8 image per
    group (computed independently), to fp32 rounding; each row's result the same at any row count; tiling keeps
    every byte."""
    if not native.vnni_ready():
        pytest.skip("no integer-activation products for int3k / int2k with these kernels (AVX-512 without VNNI)")
    stored = fmt.quantize(torch.randn(n, K, generator=gen(0)) * torch.logspace(-3, 0, n)[:, None])
    x = torch.randn(rows, K, generator=gen(1))
    x[:, 5] *= 100  # an outlier channel: its group's scale widens
    x = x.bfloat16().float()  # float32 in, so float32 out
    b = torch.randn(n, generator=gen(2))
    w = fmt.dequantize(stored, K)
    codes, scale_bytes = native.tile_lowbit(stored["qweight"], stored["scales"])
    for tiled, as_stored in ((codes, stored["qweight"]), (scale_bytes, stored["scales"])):
        assert torch.equal(tiled.flatten().sort().values, as_stored.flatten().sort().values)
    product = native.vnni_lowbit_product(codes, scale_bytes, stored["row_scales"], fmt.bits, b)
    got = product(x)
    assert rel_err(got, F.linear(span_activations(x, min(fmt.group_size, native.CHUNK)), w, b)) < 2e-5  # measured 1-5e-7
    assert rel_err(got, F.linear(x, w, b)) < 5e-2  # measured 0.7-3e-2: int8 activations, the outlier's group worst
    assert torch.equal(got, torch.cat([product(x[i:i + 1]) for i in range(rows)]))
    if K == 384 and fmt.group_size < 96:  # groups of 96: whole 32s (lowbit_product takes them), not a division of 128
        with pytest.raises(ValueError, match="groups of 16, 32, 64 or 128"):
            native.vnni_lowbit_product(codes, scale_bytes[:, :4].contiguous(), stored["row_scales"], fmt.bits)


def test_a_lowbit_model_runs_on_its_native_products(tmp_path, monkeypatch):
    """A checkpoint quantized to int3k runs every linear on VnniLowBit (integer activations in lanes) where these
    kernels have it, else NativeLowBit: a few rows (the product) and a prefill give the reference kernel's logits
    up to bf16 rounding (and int8 activations), and it generates (decode steps in the fused C call)."""
    from qlite import kernels
    from qlite.pipeline import load
    from quantize.convert import convert
    src = make_checkpoint(tmp_path / "src", seed=4, **NATIVE_WIDTHS)
    out = convert(src, tmp_path / "q", scheme="intk", bits=3, group_size=32, lm_head_bits=16, progress=False,
                  report=False).out_dir
    fast, ref = load_model(out), load_model(out, kernel="reference")
    names = {m.kernel.name for m in fast.modules() if isinstance(m, QuantLinear)}
    lanes = native.vnni_ready()
    assert names == {"vnni-lowbit" if lanes else "native-lowbit"}, names
    for length in (5, 40):  # native-lowbit: at most native.MAX_ROWS rows the product, more a prefill
        ids = torch.randint(0, 500, (1, length), generator=gen(length))
        with torch.no_grad():  # measured: 2.4e-2 with int8 activations
            assert rel_err(fast(ids).float(), ref(ids).float()) < (4e-2 if lanes else 2e-2)
    monkeypatch.setattr(kernels._scratch, "buf", None, raising=False)
    with torch.inference_mode():  # the prefill's scratch buffer made here, then used outside (biases need grad)
        fast(ids)
    assert torch.isfinite(fast(ids)).all()
    assert load(out).generate("the quick brown", chat=False, max_new_tokens=6)


def test_turned_inputs_are_the_rotation_rounded_to_bf16():
    """turn.h's fast transform: the torch rotation (formats.turn, a matmul) rounded to bf16, but for the odd last
    bit; a product turned first is the plain product of the turned rows, bit for bit."""
    from qlite.formats import Int3H, turn
    K = 384
    x = torch.randn(9, K, generator=gen(5)).bfloat16()
    fmt = Int3H(128)
    stored = fmt.quantize(torch.randn(64, K, generator=gen(6)) * 0.02)
    product = native.lowbit_product(stored["qweight"], stored["scales"], stored["row_scales"], 3)
    assert product.turned(x) is x
    plain = product(x)
    product.turn_with(fmt.input_signs())
    turned = product.turned(x)
    assert_bf16_close(turned, turn(x.float()).bfloat16())
    assert torch.equal(product(x), native.lowbit_product(stored["qweight"], stored["scales"], stored["row_scales"], 3)(turned))
    assert not torch.equal(product(x), plain)
    with pytest.raises(ValueError, match="K 320 is not a multiple of 128"):
        native.bf16_product(torch.zeros(8, 320, dtype=torch.bfloat16), None).turn_with(fmt.input_signs())


def test_a_rotated_model_runs_on_its_native_products(tmp_path):
    """int3h-g128 decoder linears with some int4h-g128 (q_proj apart from k/v, one down_proj at g64) run on the
    native products, which turn the activations first: a few rows and a prefill give the reference kernel's logits
    (dequantized weights, no turn) up to bf16 rounding and int8 activations, and it generates."""
    from qlite.formats import format_named
    from qlite.pipeline import load
    from qlite.qconfig import QuantConfig
    from quantize.convert import convert
    src = make_checkpoint(tmp_path / "src", seed=4, **NATIVE_WIDTHS)
    mixed = (("model.layers.0.self_attn.q_proj", format_named("int4h-g128")),
             ("model.layers.1.mlp.down_proj", format_named("int4h-g64")))
    qconfig = QuantConfig(format_named("int3h-g128"), None, embeddings=None, module_formats=mixed)
    out = convert(src, tmp_path / "q", qconfig, progress=False, report=False).out_dir
    ref = load_model(out, kernel="reference")
    for kernel in ("native", "native-a16"):
        fast = load_model(out, kernel=kernel)
        names = {m.kernel.name for m in fast.modules() if isinstance(m, QuantLinear)}
        assert not names & {"reference", "aten-int4"}, names
        for length in (5, 40):
            ids = torch.randint(0, 500, (1, length), generator=gen(length))
            with torch.no_grad():
                assert rel_err(fast(ids).float(), ref(ids).float()) < 4e-2
    assert load(out).generate("the quick brown", chat=False, max_new_tokens=6)


def assert_bf16_close(got, want):
    """Equal but for the odd last-bit rounding (the kernels sum in another order)."""
    diff = (got.float() - want.float()).abs()
    assert (diff > 0).float().mean() < 0.02
    assert (diff <= want.float().abs() * 2 ** -7 + 1e-6).all()


def test_rmsnorm_and_silu_mul_match_torch():
    x = (torch.randn(5, 256, generator=gen(0)) * 4).bfloat16()
    w = (1 + torch.randn(256, generator=gen(1)) * 0.3).bfloat16()
    xf = x.float()
    want = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()  # model.RMSNorm's steps
    assert_bf16_close(native.rmsnorm(x, w, 1e-6), want)
    gate, up = x.chunk(2, dim=-1)
    assert_bf16_close(native.silu_mul(x), F.silu(gate) * up)


def rope_angles(position: int, hd: int) -> tuple[torch.Tensor, torch.Tensor]:
    angles = position * 1e4 ** (-torch.arange(0, hd, 2) / hd)
    return torch.cat([angles, angles]).cos(), torch.cat([angles, angles]).sin()


@pytest.mark.parametrize("n_head, n_kv, hd", [(14, 2, 64), (4, 4, 64), (4, 2, 96), (6, 2, 32)])
def test_decode_attention_matches_sdpa(n_head, n_kv, hd):
    """A batch of rows, each with its own position and its own first key (left padding): each row
    against torch's attention over exactly its keys (71, 62 and 1 of them: blocks of 16 keys and the rest;
    head sizes of 4 vectors of 16, 4 and 2, 2)."""
    B, capacity, pos = 3, 100, 70
    starts = torch.tensor([0, 9, 70])  # the last row: its new token only
    qkv = torch.randn(B, (n_head + 2 * n_kv) * hd, generator=gen(0)).bfloat16()
    cache_k = torch.randn(B, n_kv, capacity, hd, generator=gen(1)).bfloat16()
    cache_v = torch.randn(B, n_kv, capacity, hd, generator=gen(2)).bfloat16()
    keys, values = cache_k.float().clone(), cache_v.float().clone()
    cos, sin = map(torch.stack, zip(*(rope_angles(pos - int(s), hd) for s in starts)))  # (B, hd) each
    got = native.decode_attention(qkv, cos, sin, cache_k, cache_v, n_head, pos, starts)
    for b, first in enumerate(starts.tolist()):
        q, k, v = qkv[b].float().split([n_head * hd, n_kv * hd, n_kv * hd])
        q, k = apply_rope(q.view(n_head, 1, hd), cos[b], sin[b]), apply_rope(k.view(n_kv, 1, hd), cos[b], sin[b])
        keys[b, :, pos], values[b, :, pos] = k[:, 0].bfloat16().float(), v.view(n_kv, hd)
        keys_b, values_b = keys[b:b + 1, :, first:pos + 1], values[b:b + 1, :, first:pos + 1]
        want = F.scaled_dot_product_attention(q[None], keys_b, values_b, enable_gqa=True)[0].reshape(-1)  # (n_head * hd,)
        assert rel_err(got[b], want) < 1e-2, b
    assert torch.equal(cache_k.float(), keys) and torch.equal(cache_v.float(), values)  # the new k, v only
    assert math.isfinite(got.float().sum().item())


def test_decode_attention_row_is_the_same_at_any_offset_in_any_batch():
    """A sequence's keys at 0..S-1 of a cache alone, or at 30..30+S-1 as row 1 of a batch: the same bits."""
    n_head, n_kv, hd, S = 4, 2, 64, 20
    qkv = torch.randn(1, (n_head + 2 * n_kv) * hd, generator=gen(0)).bfloat16()
    past_k, past_v = (torch.randn(n_kv, S - 1, hd, generator=gen(i)).bfloat16() for i in (1, 2))
    cos, sin = (t[None] for t in rope_angles(S - 1, hd))
    alone_k, alone_v = (torch.zeros(1, n_kv, 64, hd, dtype=torch.bfloat16) for _ in range(2))
    alone_k[0, :, :S - 1], alone_v[0, :, :S - 1] = past_k, past_v
    alone = native.decode_attention(qkv, cos, sin, alone_k, alone_v, n_head, S - 1)
    batch_k, batch_v = (torch.randn(3, n_kv, 64, hd, generator=gen(i)).bfloat16() for i in (3, 4))
    batch_k[1, :, 30:30 + S - 1], batch_v[1, :, 30:30 + S - 1] = past_k, past_v
    others = torch.randn(3, qkv.shape[1], generator=gen(5)).bfloat16()
    others[1] = qkv[0]
    got = native.decode_attention(others, cos.expand(3, -1), sin.expand(3, -1), batch_k, batch_v, n_head, 30 + S - 1,
                                  torch.tensor([5, 30, 0]))
    assert torch.equal(got[1], alone[0])


def test_argmax_matches_torch():
    logits = torch.randn(5, 4096, generator=gen(0)).bfloat16()
    logits[1, 100] = logits[1, 3000] = 50  # a tie: the first, as torch.argmax
    logits[2, 7] = float("nan")
    logits[3, 4095] = float("-inf")
    logits[4] = float("-inf")
    top, finite = native.argmax(logits)
    assert finite == [True, True, False, False, False]
    assert top[:2] == logits[:2].float().argmax(-1).tolist() and top[1] == 100
    assert top[3] == logits[3].float().argmax().item() and 0 <= top[4] < 4096


@pytest.fixture(scope="module")
def native_ckpts(tmp_path_factory):
    from quantize.convert import convert
    src = make_checkpoint(tmp_path_factory.mktemp("native") / "bf16", **NATIVE_WIDTHS)
    out = {"bf16": src}
    for name, bits, group in (("int8", 8, None), ("int4", 4, 64), ("int4-g128", 4, 128)):
        out[name] = convert(src, src.parent / name, bits=bits, group_size=group, progress=False).out_dir
    return out


def logits_along(ckpt, ids, dtype="bfloat16", kernel="auto"):
    """Next-token logits after a 20-token prefill, then one decode step per token (teacher forced)."""
    model = load_model(ckpt, dtype=dtype, kernel=kernel)
    cache = model.new_cache(1, ids.shape[1])
    with torch.inference_mode():
        steps = [model(ids[:, :20], cache, last_only=True)]
        steps += [model(ids[:, t:t + 1], cache) for t in range(20, ids.shape[1])]
    return torch.cat(steps, 1)[0].float(), model


def kld(ref, logits):
    return (ref.softmax(-1) * (ref.log_softmax(-1) - logits.log_softmax(-1))).sum(-1).mean().item()


RUNS_ON = {  # the kernels each backend gives the tiny checkpoints' linears
    "native-a16": {"bf16": {"native-bf16"}, "int8": {"native-int8"}, "int4": {"native-int4", "native-int8"},
                   "int4-g128": {"native-int4", "native-int8"}},
    "native": {"bf16": {"native-bf16"}, "int8": {"vnni-int8"}, "int4": {"vnni-int4", "vnni-int8"},
               "int4-g128": {"vnni-int4", "vnni-int8"}},
}


@pytest.mark.parametrize("kernel", ["native", "native-a16"])
@pytest.mark.parametrize("kind", ["bf16", "int8", "int4", "int4-g128"])
def test_native_decode_is_as_close_to_float32_as_the_torch_path(native_ckpts, kind, kernel, monkeypatch, isa):
    """Random tiny models have near-ties, so greedy tokens are compared on the demo model
    (tests/quantize/test_demo_quantized.py); here: the decode logits themselves."""
    if kernel == "native" and not native.vnni_ready():
        pytest.skip("no integer-activation kernels (AVX-512 without VNNI)")
    ids = torch.randint(0, 500, (1, 44), generator=gen(3))
    fast, model = logits_along(native_ckpts[kind], ids, kernel=kernel)
    runs_on = {m.kernel.name for m in model.modules() if isinstance(m, (torch.nn.Linear, QuantLinear))}
    assert runs_on == RUNS_ON[kernel][kind]
    ref, _ = logits_along(native_ckpts[kind], ids, "float32", "reference")
    monkeypatch.setenv("QLITE_NATIVE", "0")
    native.library.cache_clear()
    try:
        slow, _ = logits_along(native_ckpts[kind], ids)
    finally:
        monkeypatch.delenv("QLITE_NATIVE")
        native.library.cache_clear()
    # measured: 0.78-0.98x the torch path's KLD; int4 with int8 activations per group of inputs (decode steps
    # and the 20-token prefill) 3.3-3.4x on this random tiny model (on the demo model: -0.2% to +1.6% over a
    # scale per 8 inputs, docs/formats.md)
    bar = 3.75 if RUNS_ON[kernel][kind] & {"vnni-int4"} else 1.25
    assert kld(ref, fast) <= bar * kld(ref, slow)
    assert (fast - slow).abs().max() < 0.07 * ref.abs().max()  # measured 0.051


def greedy_logits(model_dir, prompt_ids, n, dtype="bfloat16", forced=None):
    """Greedy tokens from prompt_ids and the logits each was chosen from (forced: take these tokens
    instead of the argmax: teacher forcing, so that every position compares with the same past)."""
    model = load_model(model_dir, dtype=dtype)
    cache, chosen, logits = model.new_cache(1, len(prompt_ids) + n), [], []
    with torch.inference_mode():
        out = model(torch.tensor([prompt_ids]), cache, last_only=True)
        for i in range(n):
            logits.append(out[0, -1].float())
            chosen.append(forced[i] if forced else int(logits[-1].argmax()))
            out = model(torch.tensor([[chosen[-1]]]), cache)
    return chosen, torch.stack(logits)


@pytest.mark.demo
@pytest.mark.parametrize("which, reference_dtype", [("demo_dir", "float32"), ("demo_int8", "bfloat16"),
                                                    ("demo_int4", "bfloat16")])
def test_demo_greedy_answer_is_the_reference_paths(which, reference_dtype, request, isa, monkeypatch):
    """The reference's 64 greedy tokens (float32 for the 16-bit model, torch's aten kernels for the quantized
    ones, which keep bf16 activations), fed to the native path one by one: at each position the native
    kernels pick the same token, or one the reference scores within one bf16 step of its own pick (a tie
    at the logits' precision). Measured (docs/formats.md "Native kernels"): AVX-512 picks all 64 alike on all
    three; AVX2 too on int8 and int4, and differs at token 19 of the 16-bit model (float32 gap 0.058)."""
    from qlite.tokenizer import Tokenizer
    model_dir = request.getfixturevalue(which)
    tokenizer = Tokenizer(model_dir)
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": PRIME_PROMPT}]))
    monkeypatch.setenv("QLITE_NATIVE", "0")
    native.library.cache_clear()
    reference, reference_logits = greedy_logits(model_dir, prompt_ids, 64, reference_dtype)
    monkeypatch.delenv("QLITE_NATIVE")
    native.library.cache_clear()
    picks = greedy_logits(model_dir, prompt_ids, 64, forced=reference)[1].argmax(-1).tolist()
    for i, (want, got) in enumerate(zip(reference, picks)):
        gap = (reference_logits[i, want] - reference_logits[i, got]).item()
        if got != want:
            print(f"\n{isa} {which}: token {i} {tokenizer.decode([got])!r} for {tokenizer.decode([want])!r}, "
                  f"reference gap {gap:.4f}")
        top = reference_logits[i, want].abs().item()
        assert gap <= 2 ** (math.floor(math.log2(top)) - 7), (i, gap)  # one bf16 step at the top logit


def test_a_wrong_call_is_an_error_never_an_out_of_bounds_access():
    N, K = 32, 256
    x = torch.randn(1, K, dtype=torch.bfloat16)
    q8, s8 = torch.zeros(N, K, dtype=torch.int8), torch.ones(N, 2, dtype=torch.float16)
    q4, s4, z4 = torch.zeros(N, K // 2, dtype=torch.uint8), torch.ones(N, 2, dtype=torch.float16), torch.zeros(N, 2, dtype=torch.uint8)
    wrong_calls = {
        "scales as uint8": lambda: native.gemv_int8(x, q8, s8.to(torch.uint8), None),
        "qweight as float32": lambda: native.gemv_int8(x, q8.float(), s8, None),
        "scales with too few rows": lambda: native.gemv_int4(x, q4, s4[:4], z4, None),
        "zeros of another group count": lambda: native.gemv_int4(x, q4, s4, z4[:, :1], None),
        "groups that do not divide": lambda: native.gemv_int8(x, q8, torch.ones(N, 3, dtype=torch.float16), None),
        "x of another width": lambda: native.gemv_int8(x[:, :128], q8, s8, None),
        "groups of 16 in a VNNI chunk": lambda: native.gemv_vnni(x, q8, torch.ones(N, 16, dtype=torch.float16),
                                                                 None, None),
        "int4 zeros of another group count": lambda: native.gemv_vnni(x, q4, s4, z4[:, :1], None),
        "a short bias": lambda: native.gemv_bf16(x, torch.zeros(N, K, dtype=torch.bfloat16), torch.zeros(N - 1), ),
        "a strided weight": lambda: native.gemv_bf16(x, torch.zeros(K, N, dtype=torch.bfloat16).t(), None),
        "a norm weight too short": lambda: native.rmsnorm(x, torch.ones(K // 2, dtype=torch.bfloat16), 1e-6),
        "a position past the cache": lambda: native.decode_attention(
            torch.zeros(1, 4 * 64, dtype=torch.bfloat16), torch.ones(1, 64), torch.zeros(1, 64),
            torch.zeros(1, 1, 8, 64, dtype=torch.bfloat16), torch.zeros(1, 1, 8, 64, dtype=torch.bfloat16), 2, 8),
        "a row's keys starting past its token": lambda: native.decode_attention(
            torch.zeros(1, 4 * 64, dtype=torch.bfloat16), torch.ones(1, 64), torch.zeros(1, 64),
            torch.zeros(1, 1, 8, 64, dtype=torch.bfloat16), torch.zeros(1, 1, 8, 64, dtype=torch.bfloat16), 2, 5,
            torch.tensor([6])),
        "a cache of another row count": lambda: native.decode_attention(
            torch.zeros(2, 4 * 64, dtype=torch.bfloat16), torch.ones(2, 64), torch.zeros(2, 64),
            torch.zeros(1, 1, 8, 64, dtype=torch.bfloat16), torch.zeros(1, 1, 8, 64, dtype=torch.bfloat16), 2, 5),
        "logits of an odd width": lambda: native.argmax(torch.zeros(2, 100, dtype=torch.bfloat16)),
    }
    for what, call in wrong_calls.items():
        with pytest.raises(ValueError, match="native kernel"):
            call()
            pytest.fail(what)


def test_every_kernel_source_ships_with_the_package():
    """native.py compiles csrc/ on the user's machine: each file there (sources and the header they
    include) must be package data, or an installed qlite silently falls back to torch's kernels."""
    import fnmatch
    import tomllib
    from pathlib import Path
    root = Path(native.__file__).parents[1]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["qlite"]
    for f in (root / "qlite" / "csrc").iterdir():
        assert any(fnmatch.fnmatch(f"csrc/{f.name}", p) for p in patterns), f.name


@pytest.mark.parametrize("bits", [8, 4])
def test_decode_attention_on_a_quantized_cache_is_attention_over_its_decoded_keys(bits):
    """Rows with their own first keys over int8 / int4 records (keys less a per-head offset): the new
    v record is kv_quant's bytes, the new k record decodes to the rotated key less the offset, and
    the output is torch's attention over the decoded keys (offset added back) and values."""
    from qlite import kv_quant

    n_head, n_kv, B, hd, capacity, pos = 14, 2, 3, 64, 100, 70
    starts = torch.tensor([0, 9, 70])
    qkv = torch.randn(B, (n_head + 2 * n_kv) * hd, generator=gen(0)).bfloat16()
    offset = torch.randn(n_kv, hd, generator=gen(3)) * 20
    cache_k = kv_quant.encode(torch.randn(B, n_kv, capacity, hd, generator=gen(1)), bits)
    cache_v = kv_quant.encode(torch.randn(B, n_kv, capacity, hd, generator=gen(2)), bits)
    cos, sin = map(torch.stack, zip(*(rope_angles(pos - int(s), hd) for s in starts)))
    got = native.decode_attention(qkv, cos, sin, cache_k, cache_v, n_head, pos, starts, bits, offset)
    keys = kv_quant.decode(cache_k, bits, hd, torch.float32) + offset[:, None]  # (B, n_kv, capacity, hd)
    values = kv_quant.decode(cache_v, bits, hd, torch.float32)
    step = {8: 1 / 127, 4: 1 / 7}[bits]
    for b, first in enumerate(starts.tolist()):
        q, k, v = qkv[b].float().split([n_head * hd, n_kv * hd, n_kv * hd])
        q, k = apply_rope(q.view(n_head, 1, hd), cos[b], sin[b]), apply_rope(k.view(n_kv, 1, hd), cos[b], sin[b])
        assert torch.equal(cache_v[b, :, pos], kv_quant.encode(v.view(n_kv, hd).bfloat16(), bits))
        shifted = k[:, 0] - offset
        assert ((keys[b, :, pos] - offset - shifted).abs() <= step * shifted.abs().amax() + 1e-2).all()
        want = F.scaled_dot_product_attention(q[None], keys[b:b + 1, :, first:pos + 1], values[b:b + 1, :, first:pos + 1],
                                              enable_gqa=True)[0].reshape(-1)
        assert rel_err(got[b], want) < 1e-2, b


@pytest.mark.parametrize("int4", [True, False], ids=["int4", "int8"])
@pytest.mark.parametrize("n", [8, 10, 3, 37])  # whole blocks (AVX2), a partial last block, only a partial one
def test_tile_codes_puts_each_block_in_lanes(n, int4):
    """Codes in lanes: blocks of lanes_rows() rows, a
    word of 8 int4 codes or 2 int8 ones at a time."""
    if not native.vnni_ready():
        pytest.skip("no integer-activation kernels")
    K = 384
    rows_per_block, step = native.lanes_rows(), 4 if int4 else 2
    q = torch.randint(0, 256, (n, K // 2), dtype=torch.uint8, generator=gen(0)) if int4 else \
        torch.randint(-128, 128, (n, K), dtype=torch.int8, generator=gen(0))
    tiled, at = native.tile_codes(q).flatten().tolist(), 0
    for block in range(0, n, rows_per_block):
        rows = min(rows_per_block, n - block)
        for c in range(q.shape[1] // step):
            for r in range(rows):  # the block's rows side by side in each word
                assert tiled[at:at + step] == q[block + r, c * step:(c + 1) * step].tolist()
                at += step
    assert at == q.numel()
