"""The decoder's linears: qlite's `Linear` (nn.Linear whose matmul a backend may replace), the fused
projections (q/k/v as one `qkv_proj`, gate/up as one `gate_up_proj`: one matmul each) and, where the
config's quantization gives the parts of one fused projection different formats, a `SplitLinear` of them."""
from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..qlinear import QuantLinear

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class Linear(nn.Linear):
    """nn.Linear whose matmul a backend may replace with a kernel of its own (kernels.py)."""
    kernel = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) if self.kernel is None else self.kernel(x)


class SplitLinear(nn.ModuleDict):
    """Projections of one input kept apart (their formats differ); their outputs side by side."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([linear(x) for linear in self.values()], dim=-1)


def make_linear(cfg: ModelConfig, prefix: str, in_features: int, parts: dict[str, int], bias: bool) -> nn.Module:
    """The linear(s) for checkpoint modules prefix+part (out_features each) that read one input: one
    fused module when they share a format, else a SplitLinear."""
    fmts = {part: cfg.quantization.format_for(prefix + part) if cfg.quantization else None for part in parts}

    def one(fmt, out_features, where):
        if fmt is None:
            return Linear(in_features, out_features, bias=bias)
        fmt.check(in_features, where)
        return QuantLinear(in_features, out_features, bias, fmt, cfg.quantization.input_order)

    if len(set(fmts.values())) > 1:
        return SplitLinear({part: one(fmts[part], n, prefix + part) for part, n in parts.items()})
    linear = one(next(iter(fmts.values())), sum(parts.values()), prefix + next(iter(parts)))
    if len(parts) > 1:
        linear.fused_parts = tuple(parts.items())  # (checkpoint name, rows) in order
    return linear


