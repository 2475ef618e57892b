"""Activation-aware grids for qlite's asymmetric integer formats (int4-gG, int4k-gG, int3k-gG, int2k-gG):
each group's scale and zero point chosen by what the group's rounding error does to the layer's outputs
on the calibration inputs, instead of by the group's min-max range.

A group's weights w (G of them) and their rounded values w' change the outputs by (w - w') . x for
inputs x, so over the calibration tokens the squared output error is (w - w')^T H_gg (w - w'), H_gg the
group's block of H = X^T X (the GPTQ Hessian). llama.cpp's importance matrix weighs each weight by
H's diagonal alone; the block keeps the correlations between a group's inputs, which is what made the
difference on the demo model (the diagonal traded one built-in text for the other; the block lowers
both). The search: scales from the min-max one down to SHRINK of it (a narrower grid clips the
extremes and rounds the rest more finely), each with the min-max zero point, its neighbours, and the
zero point that puts the group's maximum on the top code; the least error wins (min-max's grid on a tie). The coded
formats' scales stay codes under the row's scale. Pure functions; quantize/calibrate.py runs them layer by layer on the
quantized model's own activations, as GPTQ."""
from __future__ import annotations

import torch

from qlite.formats import IntFormat, asymmetric_range, round_to_grid
from qlite.qconfig import DAMP

SHRINK = torch.linspace(1.0, 0.7, 11)  # candidate scales, as fractions of the min-max scale


def group_blocks(hessian: torch.Tensor, group_size: int, damp: float) -> torch.Tensor:
    """(groups, G, G) diagonal blocks of the damped Hessian [K, K] (damp: share of its mean diagonal)."""
    H = hessian.float()
    blocks = torch.stack([H[i:i + group_size, i:i + group_size] for i in range(0, H.shape[0], group_size)])  # copies
    blocks.diagonal(dim1=1, dim2=2).add_(damp * torch.diag(H).mean())
    return blocks


def act_grid(fmt: IntFormat, wg: torch.Tensor, blocks: torch.Tensor, rows: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) [N, groups] of weight groups wg (N, groups, G) with the least output error
    (w - w')^T B (w - w') for their Hessian blocks (groups, G, G); rows: int4k's row scales [N, 1]."""
    lo, range_scale = asymmetric_range(wg, fmt.hi)  # (N, groups)
    hi = wg.amax(-1).clamp(min=0)
    best = None
    for shrink in SHRINK:
        scale = fmt.search_scale(range_scale * shrink, rows)
        z = torch.round(-lo / scale)
        for zero in (z, z - 1, z + 1, torch.round(fmt.hi - hi / scale)):  # min-max's first: it wins ties
            zero = zero.clamp(fmt.lo, fmt.hi)
            q = round_to_grid(wg, scale[..., None], zero[..., None], fmt.lo, fmt.hi)
            err = wg - (q - zero[..., None]) * scale[..., None]  # (N, groups, G)
            cost = torch.einsum("ngi,gij,ngj->ng", err, blocks, err)  # (N, groups)
            if best is None:
                best = [cost, scale, zero]
            else:
                better = cost < best[0]
                best = [torch.where(better, new, old) for new, old in zip((cost, scale, zero), best)]
    return best[1], best[2]


def act_quantize(weight: torch.Tensor, hessian: torch.Tensor, fmt: IntFormat, damp: float = DAMP
                 ) -> dict[str, torch.Tensor]:
    """Round weight [N, K] to nearest on act_grid's grids (formats without one: min-max, fmt.quantize);
    returns fmt's stored tensors."""
    if not fmt.act_aware:
        return fmt.quantize(weight)
    blocks = group_blocks(fmt.stored_hessian(hessian), fmt.group_size, damp)  # quantize rounds fmt.stored_basis(weight)
    return fmt.quantize(weight, grid=lambda wg, rows: act_grid(fmt, wg, blocks, rows))
