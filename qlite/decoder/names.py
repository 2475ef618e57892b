"""Checkpoint names: which tensors of a checkpoint (HF names) make each tensor of the decoder's state
dict (whose fused projections concatenate the checkpoint's, row blocks in order)."""
from __future__ import annotations

import re

from torch import nn

def checkpoint_module(name: str) -> str:
    """The checkpoint's name for a module of the model: a SplitLinear's parts drop the fused name."""
    return re.sub(r"\.(?:qkv_proj|gate_up_proj)\.", ".", name)


def linear_parts(name: str, linear: nn.Module) -> list[tuple[str, int]]:
    """(checkpoint module name, rows) of each part of a linear module, in row order: one for a plain
    linear, the fused projections' parts for qkv_proj / gate_up_proj."""
    parent, _, own = checkpoint_module(name).rpartition(".")
    parts = getattr(linear, "fused_parts", None) or ((own, linear.out_features),)
    return [(f"{parent}.{part}".lstrip("."), rows) for part, rows in parts]


SHARED_BY_PARTS = ("input_order",)  # buffers of a fused linear that every part holds whole (equal), not by rows


def checkpoint_layout(model: nn.Module) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """For every tensor of the model's state dict, the checkpoint tensors (name, shape) whose rows,
    concatenated in order, make it (SHARED_BY_PARTS: each part holds it whole). A tensor shared with
    another (tied lm_head) is listed once."""
    modules = dict(model.named_modules())
    layout, seen = {}, set()
    for key, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        module, _, tensor = key.rpartition(".")
        if getattr(modules[module], "fused_parts", None) is None:
            layout[key] = [(f"{checkpoint_module(module)}.{tensor}".lstrip("."), tuple(t.shape))]
        else:
            layout[key] = [(f"{part}.{tensor}", tuple(t.shape) if tensor in SHARED_BY_PARTS else (rows, *t.shape[1:]))
                           for part, rows in linear_parts(module, modules[module])]
    return layout


def checkpoint_shapes(layout: dict[str, list[tuple[str, tuple[int, ...]]]]) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor a layout names, with its shape."""
    return {name: shape for parts in layout.values() for name, shape in parts}
