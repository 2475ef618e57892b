"""QuantLinear: a drop-in for nn.Linear holding int8 or int4 group-quantized weights in qlite's
canonical layout (formats.py) plus a float bias; its forward goes through a kernel (kernels.py)
chosen once at load, which may repack the weights into its own layout."""
from __future__ import annotations

import torch
from torch import nn

from .errors import QliteError
from .formats import (Format, dequantize_int4, dequantize_int8, dequantize_llm_int8, dequantize_nf4, module_format,
                      parse_quantization_config)


class QuantLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, fmt: Format):
        super().__init__()
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        for name, (dtype, shape) in fmt.stored_shapes(out_features, in_features).items():
            self.register_buffer(name, torch.empty(shape, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.kernel = None  # set by kernels.prepare

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] the stored codes stand for."""
        if self.fmt.scheme == "nf4":
            return dequantize_nf4(self.qweight, self.absmax, self.in_features)
        if self.fmt.scheme == "llm.int8":
            return dequantize_llm_int8(self.qweight, self.scb)
        if self.fmt.bits == 8:
            return dequantize_int8(self.qweight, self.scales)
        return dequantize_int4(self.qweight, self.scales, self.zeros, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel.forward(self, x)

    def extra_repr(self) -> str:
        kernel = self.kernel.name if self.kernel else "unprepared"
        return f"{self.in_features}, {self.out_features}, {self.fmt.name}, bias={self.bias is not None}, kernel={kernel}"


def linear_modules(model: nn.Module):
    """(dotted name, parent, attribute, module) for every nn.Linear or QuantLinear."""
    for name, parent in model.named_modules():
        for attr, child in parent.named_children():
            if isinstance(child, (nn.Linear, QuantLinear)):
                yield f"{name}.{attr}" if name else attr, parent, attr, child


def swap_quantized_modules(model: nn.Module, qconfig: dict, source: str) -> None:
    """Replace each nn.Linear that the quantization config names by a QuantLinear (on the meta device)."""
    q = parse_quantization_config(qconfig, source)  # validated with the config already; cheap
    for name, parent, attr, lin in list(linear_modules(model)):
        fmt = module_format(q, name)
        if fmt is None:
            continue
        fmt.check(lin.in_features, name)
        with torch.device("meta"):
            setattr(parent, attr, QuantLinear(lin.in_features, lin.out_features, lin.bias is not None, fmt))


def prepare_for_kernel(model: nn.Module, kernel: str = "auto", dtype: torch.dtype = torch.bfloat16) -> None:
    from .kernels import choose_kernel

    for name, _, _, mod in linear_modules(model):
        if isinstance(mod, QuantLinear):
            k = choose_kernel(mod, kernel)
            if k is None:
                raise QliteError(f"--kernel {kernel}: cannot run {name} ({mod.fmt.name}, "
                                 f"{mod.out_features}x{mod.in_features}) on {mod.qweight.device}; try --kernel auto")
            k.prepare(mod)
            mod.kernel = k
