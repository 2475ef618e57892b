"""Fuse the projections that read the same input into one matmul, once, at load: q/k/v into
qkv_proj, gate/up into gate_up_proj. Rows are concatenated, so the result is exact; quantized
layers are fused in their canonical layout (every stored tensor is per output row), before a
kernel repacks them. Projections of different kinds (say, one skipped by quantization) stay apart."""
from __future__ import annotations

import torch
from torch import nn

from .qlinear import QuantLinear


def concat_linears(linears: list[nn.Module]) -> nn.Module | None:
    first = linears[0]
    has_bias = [m.bias is not None for m in linears]
    if len(set(has_bias)) != 1 or len({m.in_features for m in linears}) != 1:
        return None
    out_features = sum(m.out_features for m in linears)
    bias = torch.cat([m.bias for m in linears]) if has_bias[0] else None
    if all(type(m) is nn.Linear for m in linears):
        with torch.device("meta"):
            fused = nn.Linear(first.in_features, out_features, bias=has_bias[0])
        fused.weight = nn.Parameter(torch.cat([m.weight for m in linears]), requires_grad=False)
    elif all(isinstance(m, QuantLinear) for m in linears) and len({m.fmt for m in linears}) == 1:
        with torch.device("meta"):
            fused = QuantLinear(first.in_features, out_features, has_bias[0], first.fmt)
        for name, _ in first.named_buffers():
            setattr(fused, name, torch.cat([getattr(m, name) for m in linears]))
    else:
        return None
    if bias is not None:
        fused.bias = nn.Parameter(bias, requires_grad=False)
    return fused


def fuse_projections(model) -> None:
    for layer in model.model.layers:
        for parent, names, fused_name in ((layer.self_attn, ("q_proj", "k_proj", "v_proj"), "qkv_proj"),
                                          (layer.mlp, ("gate_proj", "up_proj"), "gate_up_proj")):
            fused = concat_linears([getattr(parent, n) for n in names])
            if fused is not None:
                setattr(parent, fused_name, fused)
                for n in names:
                    delattr(parent, n)
