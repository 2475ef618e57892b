"""Every kernel against the reference (dequantize then F.linear)."""
import pytest
import torch

from qlite.errors import QliteError
from qlite.formats import Format, pack_int4
from qlite import native
from qlite.kernels import AtenInt4, AtenInt8, BnbInt8, BnbNF4, NativeInt4, NativeInt8, Reference, choose_kernel
from qlite.qlinear import QuantLinear
from quantize.bnb import quantize_llm_int8, quantize_nf4
from quantize.rtn import quantize_int4, quantize_int8

FORMATS = [Format(8, None, True), Format(4, 128, False), Format(4, 64, True), Format(4, 32, False)]


def make_layer(n, k, fmt, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    layer = QuantLinear(k, n, bias, fmt)
    if fmt.scheme == "nf4":
        layer.qweight, layer.absmax = quantize_nf4(w, fmt.group_size)
    elif fmt.scheme == "llm.int8":
        layer.qweight, layer.scb = quantize_llm_int8(w)
    elif fmt.bits == 8:
        layer.qweight, layer.scales = quantize_int8(w, fmt.group_size)
    else:
        q, layer.scales, layer.zeros = quantize_int4(w, fmt.group_size, fmt.symmetric)
        layer.qweight = pack_int4(q)
    if bias:
        layer.bias = torch.nn.Parameter(torch.randn(n, generator=g).to(torch.bfloat16))
    layer.kernel = Reference
    return layer


@pytest.mark.parametrize("backend", ["aten", "native"])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("n", [256, 40, 37])  # output widths that are not multiples of 8 or 16
@pytest.mark.parametrize("rows", [1, 9])  # 2 x 9 rows: native's prefill path (dequantize, bf16 matmul)
@pytest.mark.parametrize("bias", [True, False])
def test_fast_kernels_match_reference(backend, fmt, n, rows, bias):
    layer = make_layer(n, 256, fmt, bias)
    x = torch.randn(2, rows, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    expected = layer(x).float()
    kernel = choose_kernel(layer, backend)
    if backend == "native":
        if native.library() is None:
            pytest.skip("native kernels unavailable here")
        if fmt.bits == 4 and fmt.group_size % 64:
            assert kernel is None  # its int4 blocks are 64 wide; auto falls back to aten
            return
    assert kernel is {"aten": (AtenInt8, AtenInt4), "native": (NativeInt8, NativeInt4)}[backend][fmt.bits == 4]
    kernel.prepare(layer)
    layer.kernel = kernel
    got = layer(x)
    assert got.shape == expected.shape and got.dtype == torch.bfloat16
    rel = ((got.float() - expected).norm() / expected.norm()).item()
    assert rel <= 1e-2


@pytest.mark.parametrize("fmt, kernel", [(Format(4, 64, True, "nf4"), BnbNF4), (Format(8, None, True, "llm.int8"), BnbInt8)],
                         ids=["nf4", "llm.int8"])
@pytest.mark.parametrize("n", [128, 37])
def test_bitsandbytes_kernels_match_reference(fmt, kernel, n):
    layer = make_layer(n, 256, fmt)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    expected = layer(x).float()  # reference: our own dequantization (NF4 table lookup, nibble order)
    assert choose_kernel(layer, "auto") is kernel
    kernel.prepare(layer)
    layer.kernel = kernel
    rel = ((layer(x).float() - expected).norm() / expected.norm()).item()
    assert rel <= 1e-2


def test_nf4_dequantization_matches_bitsandbytes():
    from qlite.formats import dequantize_nf4, load_bitsandbytes
    F = load_bitsandbytes().functional
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(3))
    packed, state = F.quantize_4bit(w, blocksize=64, quant_type="nf4")
    q, absmax = quantize_nf4(w, 64)
    assert torch.equal(dequantize_nf4(q, absmax, 128), F.dequantize_4bit(packed, state).float())


def test_float32_activations_come_back_float32():
    layer = make_layer(64, 128, Format(4, 64, False))
    AtenInt4.prepare(layer)
    layer.kernel = AtenInt4
    assert layer(torch.randn(1, 128)).dtype == torch.float32


def test_grouped_int8_runs_native_or_reference_and_aten_refuses_it():
    layer = make_layer(64, 256, Format(8, 128, True))
    assert choose_kernel(layer, "auto") is (Reference if native.library() is None else NativeInt8)
    assert choose_kernel(layer, "aten") is None
    with pytest.raises(QliteError, match="--kernel"):
        choose_kernel(layer, "cuda-magic")
