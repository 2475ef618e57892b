"""GPTQ (Frantar et al., 2022, "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers"): quantize a linear layer's columns one at a time, spreading each column's rounding
error over the columns not yet quantized through the inverse Hessian H = 2 X^T X of the layer's
inputs. Lazy batch updates in blocks of 128 columns; optional act-order (columns by descending
diag(H)) with static groups, so the output stays in the canonical group layout and act-order costs
nothing at inference (no per-call gather). Each group's grid (asymmetric int4) is the activation-aware
one (quantize/act_grid.py: the least output error under the group's block of H), chosen when the
column pass reaches the group, from the weights as GPTQ has updated them.

`gptq_linear` is the pure math for one weight; `quantize/calibrate.py` runs it layer by layer."""
from __future__ import annotations

import torch

from qlite.errors import QliteError
from qlite.formats import IntFormat, round_to_grid
from qlite.qconfig import DAMP
from .act_grid import act_grid, group_blocks

BLOCK = 128


class Hessian:
    """X^T X of a linear's inputs, summed batch by batch in float32 (scale is irrelevant: damping is
    relative). Only the block rows on and right of the diagonal are multiplied (a little over half the
    products: at 7B's down_proj, 18944 inputs, the full product was the largest cost of a layer); the
    lower blocks are mirrored once, in place, when the matrix is read."""
    BLOCK_COLUMNS = 2048

    def __init__(self, in_features: int):
        self.h = torch.zeros(in_features, in_features)
        self.tokens = 0  # inputs added so far

    def add(self, x: torch.Tensor) -> None:
        x2 = x.reshape(-1, x.shape[-1]).float()  # (tokens, K)
        self.tokens += x2.shape[0]
        for b0 in range(0, x2.shape[1], self.BLOCK_COLUMNS):
            b1 = b0 + self.BLOCK_COLUMNS
            self.h[b0:b1, b0:].addmm_(x2[:, b0:b1].t(), x2[:, b0:])  # (B, K - b0)

    def matrix(self) -> torch.Tensor:
        """The whole symmetric matrix (K, K); the accumulator is spent."""
        h, self.h = self.h, None
        for b0 in range(0, h.shape[0], self.BLOCK_COLUMNS):
            b1 = b0 + self.BLOCK_COLUMNS
            h[b1:, b0:b1] = h[b0:b1, b1:].t()
        return h


def hessian_of(x: torch.Tensor) -> torch.Tensor:
    """X^T X of inputs x (..., K) in one batch."""
    acc = Hessian(x.shape[-1])
    acc.add(x)
    return acc.matrix()


def gptq_linear(weight: torch.Tensor, hessian: torch.Tensor, fmt: IntFormat, damp: float = DAMP,
                act_order: bool = False, chunk_rows: int = 4096) -> dict[str, torch.Tensor]:
    """Quantize weight [N, K] given the Hessian [K, K] of its inputs; returns the stored tensors of
    `fmt` (as `fmt.quantize` does for RTN). Rows are independent given H, so they
    are done chunk_rows at a time: an lm_head of 150k rows never needs more than a chunk's copies."""
    if not fmt.calibrated:
        raise QliteError(f"GPTQ makes qlite's int formats, not {fmt.name}")
    weight, hessian = fmt.stored_basis(weight), fmt.stored_hessian(hessian)  # a rotated format's W R, R^T H R
    K = weight.shape[1]
    G = fmt.group_size or K
    if G != K and BLOCK % G and G % BLOCK:
        raise QliteError(f"--group-size {G}: GPTQ needs a group size that divides {BLOCK} or is a multiple of it")
    # at most two (K, K) copies beside the caller's (the act-order gather, the factorisations): 1.4 GB each at K = 18944
    H = hessian.float().clone()
    dead = torch.diag(H) == 0  # inputs that are always zero: any value works, pick 0
    H[dead, dead] = 1
    blocks = group_blocks(H, G, damp) if fmt.act_aware else None  # (groups, G, G), canonical column order
    perm = torch.argsort(torch.diag(H), descending=True) if act_order else torch.arange(K)
    if act_order:
        H = H[perm[:, None], perm]
    H.diagonal().add_(damp * torch.diag(H).mean())
    try:
        L = torch.linalg.cholesky(H)
        del H
        Hinv = torch.cholesky_inverse(L)
        del L
        Hinv = torch.linalg.cholesky(Hinv, upper=True)
    except torch.linalg.LinAlgError:
        raise QliteError(f"GPTQ: the Hessian is not positive definite even with --damp {damp}; raise --damp") from None
    parts = [_gptq_rows(weight[r:r + chunk_rows], Hinv, perm, dead, fmt, act_order, blocks)
             for r in range(0, weight.shape[0], chunk_rows)]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def _gptq_rows(weight: torch.Tensor, Hinv: torch.Tensor, perm: torch.Tensor, dead: torch.Tensor, fmt: IntFormat,
               act_order: bool, blocks: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The column-by-column pass for some rows; Hinv is the upper Cholesky factor of the inverse of
    the (permuted, damped) Hessian; blocks: the Hessian's group blocks for act_grid (None: min-max grids)."""
    W = weight.float().clone()
    N, K = W.shape
    G = fmt.group_size or K
    lo, hi = fmt.lo, fmt.hi

    def params(wg: torch.Tensor, rows: torch.Tensor | None, first: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, zero) of groups wg (N, groups, G) from group `first` on."""
        if blocks is None:
            return fmt.grid(wg, rows)
        return act_grid(fmt, wg, blocks[first:first + wg.shape[1]], rows)

    scale = torch.zeros(N, K // G)
    zero = torch.zeros(N, K // G)
    W[:, dead] = 0
    rows = fmt.row_scales(W.reshape(N, K // G, G))  # int4k's scales of scales: from the original weights
    if act_order:  # static groups: every group's grid from the original weights, fixed up front
        scale[:], zero[:] = params(W.reshape(N, K // G, G), rows, 0)  # (N, groups)
    W = W[:, perm]

    Q = torch.zeros_like(W)  # integer codes, in permuted column order
    for i1 in range(0, K, BLOCK):
        i2 = min(i1 + BLOCK, K)
        W1, Hinv1 = W[:, i1:i2].clone(), Hinv[i1:i2, i1:i2]
        Err1 = torch.zeros_like(W1)
        for i in range(i2 - i1):
            col = int(perm[i1 + i])
            g = col // G
            if not act_order and col % G == 0:  # a new group: its grid from the current weights
                group = W1[:, i:i + G] if G <= BLOCK else W[:, i1 + i:i1 + i + G]
                scale[:, g:g + 1], zero[:, g:g + 1] = params(group[:, None], rows, g)
            w, d = W1[:, i], Hinv1[i, i]
            q = round_to_grid(w, scale[:, g], zero[:, g], lo, hi)
            Q[:, i1 + i] = q
            err = (w - (q - zero[:, g]) * scale[:, g]) / d
            W1[:, i:] -= err[:, None] * Hinv1[i, i:][None, :]
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]  # the block's errors, passed on to the later columns at once
    del W
    codes_orig = torch.empty_like(Q)
    codes_orig[:, perm] = Q  # back to the original column order
    return fmt.encode(codes_orig, scale, zero, rows)
