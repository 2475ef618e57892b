"""Round-to-nearest quantization: pure functions from a float weight [N, K] to integer codes, scales
and zero points in qlite's canonical layout (see qlite/formats.py). Scales are rounded to float16
before the codes are computed, so the stored (codes, scales) pair is self-consistent. The per-group
parameter functions are shared with GPTQ, which quantizes column by column with the same grid."""
from __future__ import annotations

import torch

FP16_SMALLEST = 2.0 ** -24  # the smallest positive float16: a scale must not round to zero
INT8_MAX = 127


def _fp16_scale(scale: torch.Tensor) -> torch.Tensor:
    return scale.clamp(min=FP16_SMALLEST).half().float()


def _groups(w: torch.Tensor, group_size: int | None) -> torch.Tensor:
    N, K = w.shape
    G = K if group_size is None else group_size
    return w.float().reshape(N, K // G, G)  # (N, groups, G)


def int8_params(wg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 grid of weight groups wg (..., G): (scale, zero) with zero 0."""
    scale = _fp16_scale(wg.abs().amax(-1) / INT8_MAX)
    return scale, torch.zeros_like(scale)


def int4_params(wg: torch.Tensor, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """int4 grid of weight groups wg (..., G): w ~ (q - z) * s with q in 0..15. Asymmetric: s =
    (max - min) / 15 over a range that includes 0 (so a constant group is exact too), integer zero
    point z; symmetric: s = absmax / 7.5 (the whole of -8..7 where the sign allows), z = 8."""
    if symmetric:
        scale = _fp16_scale(wg.abs().amax(-1) / 7.5)
        return scale, torch.full_like(scale, 8)
    lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
    scale = _fp16_scale((hi - lo) / 15)
    return scale, torch.round(-lo / scale).clamp(0, 15)


def codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Integer codes (float tensor) of w on the grid (q - zero) * scale, q in lo..hi (broadcasting)."""
    return (torch.round(w / scale) + zero).clamp(lo, hi)


def quantize_int8(w: torch.Tensor, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8: q in [-127, 127], one scale per output channel (or per group).
    Returns (qweight int8 [N, K], scales fp16 [N, groups])."""
    wg = _groups(w, group_size)
    scale, zero = int8_params(wg)  # (N, groups)
    q = codes(wg, scale[..., None], zero[..., None], -INT8_MAX, INT8_MAX).to(torch.int8)
    return q.reshape(w.shape), scale.half()


def quantize_int4(w: torch.Tensor, group_size: int, symmetric: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int4 codes in 0..15 with w ~ (q - z) * s per group (see int4_params).
    Returns (codes uint8 [N, K], scales fp16 [N, groups], zeros uint8 [N, groups])."""
    wg = _groups(w, group_size)
    scale, zero = int4_params(wg, symmetric)  # (N, groups)
    q = codes(wg, scale[..., None], zero[..., None], 0, 15).to(torch.uint8)
    return q.reshape(w.shape), scale.half(), zero.to(torch.uint8)


def quantize_rows(w: torch.Tensor, quantize, chunk_rows: int = 4096, **kwargs) -> tuple[torch.Tensor, ...]:
    """Apply a row-wise quantizer in chunks of rows, so a large matrix (an lm_head of 150k rows)
    never has more than one chunk's float32 temporaries alive."""
    parts = [quantize(w[i:i + chunk_rows], **kwargs) for i in range(0, w.shape[0], chunk_rows)]
    return tuple(torch.cat(p) for p in zip(*parts))


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: 10 log10(|x|^2 / |x - x'|^2)."""
    ref = reference.float()
    noise = (ref - approx.float()).pow(2).sum().clamp(min=1e-30)
    return float(10 * torch.log10(ref.pow(2).sum() / noise))
