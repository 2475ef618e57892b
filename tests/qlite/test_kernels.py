"""Every kernel against the reference (dequantize then F.linear), and the backend table."""
import pytest
import torch

from qlite import native
from qlite.backends import BACKENDS, choose_kernel
from qlite.errors import QliteError
from qlite.formats import Int4, Int4K, Int8, format_named
from qlite.kernels import (AtenInt4, AtenInt8, BnbInt8, BnbNF4, NativeInt4, NativeInt8, Reference, VnniInt4,
                           VnniInt8, row_bucket)
from qlite.qlinear import QuantLinear

FORMATS = [Int8(), Int8(32), Int4(128), Int4(64, True), Int4(32), Int4K(64), Int4K(32)]


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
        return (AtenInt8 if fmt.group_size is None else None, AtenInt4)[int4]  # aten's int8 is per channel
    group = fmt.group_size or 128
    vnni = backend == "native" and native.vnni_ready() and (group % native.CHUNK == 0 or group in (32, 64))
    return ((VnniInt8, VnniInt4) if vnni else (NativeInt8, NativeInt4))[int4]


@pytest.mark.parametrize("backend", ["aten", "native", "native-a16"])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("n", [256, 40, 37])  # output widths that are not multiples of 8 or 16
@pytest.mark.parametrize("rows", [1, 5, 9, 17])  # per sequence; 9: native-a16's prefill path, 17: prefill for all
@pytest.mark.parametrize("bias", [True, False])
def test_fast_kernels_match_reference(backend, fmt, n, rows, bias):
    layer = make_layer(n, 256, fmt, bias)
    x = torch.randn(2, rows, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    expected = layer(x).float()  # no kernel set: the reference
    kernel = choose_kernel(layer, backend)
    if backend.startswith("native"):
        if native.library() is None:
            pytest.skip("native kernels unavailable here")
        if fmt.bits == 4 and fmt.group_size % 64 and not (backend == "native" and native.vnni_ready()):
            assert kernel is None  # its bf16 int4 product takes 64 weights a step; auto falls back to aten
            return
    assert kernel is expected_kernel(backend, fmt)
    if kernel is None:  # aten has no grouped int8 product
        return
    layer.kernel = kernel(layer)
    got = layer(x)
    assert got.shape == expected.shape and got.dtype == torch.bfloat16
    rel = ((got.float() - expected).norm() / expected.norm()).item()
    assert rel <= 1e-2
    assert torch.equal(layer.dequantize(), make_layer(n, 256, fmt, bias).dequantize())  # canonical buffers kept


@pytest.mark.parametrize("backend", ["native", "native-a16"])
@pytest.mark.parametrize("fmt", [Int8(), Int4(128)], ids=lambda f: f.name)
def test_native_path_goes_by_rows_per_sequence(backend, fmt):
    """20 sequences of one token (a decode step of a large batch) take the few-row path, the same as
    each alone: a sequence's numbers never depend on the others (bitwise)."""
    if native.library() is None:
        pytest.skip("native kernels unavailable here")
    layer = make_layer(64, 256, fmt)
    layer.kernel = choose_kernel(layer, backend)(layer)
    x = torch.randn(20, 1, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    batch = layer(x)
    assert all(torch.equal(batch[i], layer(x[i:i + 1])[0]) for i in range(20))


def test_prefill_matmuls_run_at_few_row_counts(monkeypatch):
    """The dequantize + bf16 matmul path pads rows to a bucket (oneDNN keeps a compiled kernel per
    row count): 48 shapes up to 4096 rows, each within 12.5% of the rows or 15 more; the same results."""
    assert len({row_bucket(m) for m in range(1, 4097)}) == 48
    assert all(m <= row_bucket(m) <= max(m + 15, 1.125 * m) and row_bucket(m) % 16 == 0 for m in range(1, 5000))
    layer = make_layer(64, 256, Int4(128))
    layer.kernel = choose_kernel(layer, "native-a16")(layer) if native.library() is not None else None
    if layer.kernel is None:
        pytest.skip("native kernels unavailable here")
    seen = []
    real = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda x, *a: seen.append(x.shape[0]) or real(x, *a))
    x = torch.randn(30, 13, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    got = layer(x)  # 13 rows per sequence: past native-a16's few-row path; 390 rows: bucket 416
    assert seen == [416]
    want = real(x.reshape(-1, 256), layer.dequantize().bfloat16()).reshape(30, 13, 64) + layer.bias
    assert torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2)


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
    for name in ("int8", "int8-g64", "int4-g32", "int4-g128-sym", "int4k-g32", "nf4-b64", "llm.int8"):
        layer = make_layer(16, 128, format_named(name))
        assert choose_kernel(layer, "auto") is not None and choose_kernel(layer, "reference") is Reference
    assert BACKENDS["reference"].dense == ()
