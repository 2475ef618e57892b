"""Every kernel against the reference (dequantize then F.linear)."""
import pytest
import torch

from qlite.errors import QliteError
from qlite.formats import Format, pack_int4
from qlite.kernels import AtenInt4, AtenInt8, Reference, choose_kernel
from qlite.qlinear import QuantLinear
from quantize.rtn import quantize_int4, quantize_int8

FORMATS = [Format(8, None, True), Format(4, 128, False), Format(4, 64, True), Format(4, 32, False)]


def make_layer(n, k, fmt, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    layer = QuantLinear(k, n, bias, fmt)
    if fmt.bits == 8:
        layer.qweight, layer.scales = quantize_int8(w, fmt.group_size)
    else:
        q, layer.scales, layer.zeros = quantize_int4(w, fmt.group_size, fmt.symmetric)
        layer.qweight = pack_int4(q)
    if bias:
        layer.bias = torch.nn.Parameter(torch.randn(n, generator=g).to(torch.bfloat16))
    layer.kernel = Reference
    return layer


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("n", [256, 40, 37])  # output widths that are not multiples of 8 or 16
@pytest.mark.parametrize("rows", [1, 9])
@pytest.mark.parametrize("bias", [True, False])
def test_fast_kernels_match_reference(fmt, n, rows, bias):
    layer = make_layer(n, 256, fmt, bias)
    x = torch.randn(2, rows, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    expected = layer(x).float()
    kernel = choose_kernel(layer, "aten")
    assert kernel is (AtenInt8 if fmt.bits == 8 else AtenInt4)
    kernel.prepare(layer)
    layer.kernel = kernel
    got = layer(x)
    assert got.shape == expected.shape and got.dtype == torch.bfloat16
    rel = ((got.float() - expected).norm() / expected.norm()).item()
    assert rel <= 1e-2


def test_float32_activations_come_back_float32():
    layer = make_layer(64, 128, Format(4, 64, False))
    AtenInt4.prepare(layer)
    layer.kernel = AtenInt4
    assert layer(torch.randn(1, 128)).dtype == torch.float32


def test_grouped_int8_falls_back_to_reference_and_aten_refuses_it():
    layer = make_layer(64, 256, Format(8, 128, True))
    assert choose_kernel(layer, "auto") is Reference
    assert choose_kernel(layer, "aten") is None
    with pytest.raises(QliteError, match="--kernel"):
        choose_kernel(layer, "cuda-magic")
