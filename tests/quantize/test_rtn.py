"""Round-to-nearest math: exact packing round trips, SQNR floors that fail when the math is wrong."""
import pytest
import torch

from qlite.formats import Format, dequantize_int4, dequantize_int8, pack_int4, unpack_int4
from quantize.rtn import quantize_int4, quantize_int8, quantize_rows, sqnr_db


@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (16, 2), (7, 33), (4, 256)])
def test_int4_pack_round_trip_is_exact(shape):
    codes = torch.randint(0, 16, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    packed = pack_int4(codes)
    assert packed.shape == (shape[0], (shape[1] + 1) // 2) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed, shape[1]), codes)


def test_every_nibble_pair_packs_to_its_byte():
    lo, hi = torch.meshgrid(torch.arange(16), torch.arange(16), indexing="ij")
    codes = torch.stack([lo.flatten(), hi.flatten()], dim=1).to(torch.uint8)  # (256, 2): all pairs
    assert pack_int4(codes)[:, 0].tolist() == [int(a) | int(b) << 4 for a, b in codes]
    assert torch.equal(unpack_int4(pack_int4(codes), 2), codes)


def weights(n=512, k=1024, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02


# Floors set a little under what random Gaussian weights measure (int8 42.1 dB per channel,
# int4 asymmetric 21.8 / 20.8 / 19.9 dB at g32 / g64 / g128, symmetric g128 19.1 dB).
@pytest.mark.parametrize("group_size, floor", [(None, 40.0), (128, 42.0)])
def test_int8_sqnr(group_size, floor):
    w = weights()
    q, s = quantize_int8(w, group_size)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    assert sqnr_db(w, dequantize_int8(q, s)) >= floor


@pytest.mark.parametrize("group_size, symmetric, floor", [(32, False, 21.0), (64, False, 20.0),
                                                          (128, False, 19.0), (128, True, 18.5)])
def test_int4_sqnr(group_size, symmetric, floor):
    w = weights()
    q, s, z = quantize_int4(w, group_size, symmetric)
    assert q.max() <= 15 and z.max() <= 15
    assert sqnr_db(w, dequantize_int4(pack_int4(q), s, z, w.shape[1])) >= floor


def test_smaller_groups_are_more_accurate():
    w = weights()
    sq = [sqnr_db(w, dequantize_int4(pack_int4(q), s, z, 1024))
          for q, s, z in (quantize_int4(w, g) for g in (256, 128, 64, 32))]
    assert sq == sorted(sq)


def test_degenerate_groups_survive():
    w = torch.zeros(4, 64)
    w[1] = 0.5  # constant positive group
    w[2] = -0.25  # constant negative group
    w[3, :32] = 1e-9  # tiny values must not make a zero scale
    q, s, z = quantize_int4(w, 32)
    back = dequantize_int4(pack_int4(q), s, z, 64)
    assert torch.isfinite(back).all() and torch.allclose(back[:3], w[:3], rtol=1e-3)  # fp16 scales
    q8, s8 = quantize_int8(w)
    assert torch.isfinite(dequantize_int8(q8, s8)).all() and (s8 > 0).all()


def test_chunked_quantization_equals_whole():
    w = weights(1000, 256)
    whole = quantize_int4(w, 64)
    chunked = quantize_rows(w, quantize_int4, chunk_rows=300, group_size=64)
    assert all(torch.equal(a, b) for a, b in zip(whole, chunked))


def test_format_table_bits_per_weight():
    assert Format(8, None, True).bits_per_weight(896) == pytest.approx(8 + 16 / 896)
    assert Format(4, 128, False).bits_per_weight(896) == pytest.approx(4 + 24 / 128)
    assert Format(4, 32, True).name == "int4-g32-sym"
