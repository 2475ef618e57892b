"""Every kernel against the reference (dequantize then F.linear), and the backend table."""
import pytest
import torch

from qlite import native
from qlite.backends import BACKENDS, choose_kernel
from qlite.errors import QliteError
from qlite.formats import Int4, Int8, format_named
from qlite.kernels import AtenInt4, AtenInt8, BnbInt8, BnbNF4, NativeInt4, NativeInt8, Reference, VnniInt4, VnniInt8
from qlite.qlinear import QuantLinear

FORMATS = [Int8(), Int4(128), Int4(64, True), Int4(32)]


def make_layer(n, k, fmt, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    layer = QuantLinear(k, n, bias, fmt)
    for name, t in fmt.quantize(w).items():
        setattr(layer, name, t)
    if bias:
        layer.bias = torch.nn.Parameter(torch.randn(n, generator=g).to(torch.bfloat16))
    return layer


def expected_kernel(backend, fmt):
    int4 = fmt.bits == 4
    if backend == "aten":
        return (AtenInt8, AtenInt4)[int4]
    vnni = backend == "native" and native.vnni_ready() and (fmt.group_size or 128) % native.CHUNK == 0
    return ((VnniInt8, VnniInt4) if vnni else (NativeInt8, NativeInt4))[int4]


@pytest.mark.parametrize("backend", ["aten", "native", "native-a16"])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("n", [256, 40, 37])  # output widths that are not multiples of 8 or 16
@pytest.mark.parametrize("rows", [1, 5, 9])  # 2 x 5: VNNI's products, native-a16's prefill; 2 x 9: prefill for all
@pytest.mark.parametrize("bias", [True, False])
def test_fast_kernels_match_reference(backend, fmt, n, rows, bias):
    layer = make_layer(n, 256, fmt, bias)
    x = torch.randn(2, rows, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    expected = layer(x).float()  # no kernel set: the reference
    kernel = choose_kernel(layer, backend)
    if backend.startswith("native"):
        if native.library() is None:
            pytest.skip("native kernels unavailable here")
        if fmt.bits == 4 and fmt.group_size % 64:
            assert kernel is None  # its int4 blocks are 64 wide; auto falls back to aten
            return
    assert kernel is expected_kernel(backend, fmt)
    layer.kernel = kernel(layer)
    got = layer(x)
    assert got.shape == expected.shape and got.dtype == torch.bfloat16
    rel = ((got.float() - expected).norm() / expected.norm()).item()
    assert rel <= 1e-2
    assert torch.equal(layer.dequantize(), make_layer(n, 256, fmt, bias).dequantize())  # canonical buffers kept


@pytest.mark.parametrize("name, kernel", [("nf4-b64", BnbNF4), ("llm.int8", BnbInt8)])
@pytest.mark.parametrize("n", [128, 37])
def test_bitsandbytes_kernels_match_reference(name, kernel, n):
    layer = make_layer(n, 256, format_named(name))
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    expected = layer(x).float()  # reference: our own dequantization (NF4 table lookup, nibble order)
    assert choose_kernel(layer, "auto") is kernel
    layer.kernel = kernel(layer)
    rel = ((layer(x).float() - expected).norm() / expected.norm()).item()
    assert rel <= 1e-2


def test_float32_activations_come_back_float32():
    layer = make_layer(64, 128, Int4(64))
    layer.kernel = AtenInt4(layer)
    assert layer(torch.randn(1, 128)).dtype == torch.float32


def test_grouped_int8_runs_native_or_reference_and_aten_refuses_it():
    layer = make_layer(64, 256, Int8(128))
    assert choose_kernel(layer, "auto") is (Reference if native.library() is None else expected_kernel("native", Int8(128)))
    assert choose_kernel(layer, "aten") is None
    with pytest.raises(QliteError, match="--kernel"):
        choose_kernel(layer, "cuda-magic")


def test_every_format_has_a_kernel_in_auto_and_reference_takes_all():
    for name in ("int8", "int8-g64", "int4-g32", "int4-g128-sym", "nf4-b64", "llm.int8"):
        layer = make_layer(16, 128, format_named(name))
        assert choose_kernel(layer, "auto") is not None and choose_kernel(layer, "reference") is Reference
    assert BACKENDS["reference"].dense == ()
