"""QuantLinear: a drop-in for nn.Linear holding weights in a quantized format's canonical layout
(formats.py) plus a float bias. Its matmul is a kernel object chosen once at load (backends.py); the
canonical buffers stay, so `dequantize()` and `state_dict()` always work, whatever the kernel.
A layer with an `input_order` (imported act-order checkpoints) stores its columns in that order and
gathers x's columns the same way before any kernel runs."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .formats import Format


class QuantLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, fmt: Format, input_order: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        for name, (dtype, shape) in fmt.stored_shapes(out_features, in_features).items():
            self.register_buffer(name, torch.empty(shape, dtype=dtype))
        # int32 [K]: stored column j is input column input_order[j] (one for all rows: not row-blocked)
        self.register_buffer("input_order", torch.empty(in_features, dtype=torch.int32) if input_order else None)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.kernel = None  # None: the reference, dequantize then F.linear

    def stored(self) -> dict[str, torch.Tensor]:
        """The format's stored tensors, by name."""
        return {name: getattr(self, name) for name in self.fmt.stored_shapes(1, self.in_features)}

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] the stored codes stand for, in stored column order."""
        return self.fmt.dequantize(self.stored(), self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_order is not None:
            x = x.index_select(-1, self.input_order)
        return reference_linear(self, x) if self.kernel is None else self.kernel(x)

    def extra_repr(self) -> str:
        kernel = self.kernel.name if self.kernel else "reference"
        return f"{self.in_features}, {self.out_features}, {self.fmt.name}, bias={self.bias is not None}, kernel={kernel}"


def reference_linear(layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """The reference every kernel is tested against: dequantize the whole weight, then F.linear."""
    bias = None if layer.bias is None else layer.bias.to(x.dtype)
    return F.linear(x, layer.dequantize().to(x.dtype), bias)
