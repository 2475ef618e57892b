"""A mixture of experts' sparse MLP in one native call a layer (csrc/decode_step.h: qlite_sparse_mlp): the
router's product, each token's top k, each chosen expert once over the tokens that chose it, the weighted sum
and the shared expert, with the products the layers' kernels hold (fused.py's descriptors). NativeOps runs
it for decoder/mlp.py's SparseMLP, and the fused decode step calls the same function, so the two agree bit
for bit. An expert whose kernel is deferred (backends.use_backend: its codes tiled when first used) is made
when a token first chooses it, through a callback from C: an expert never chosen is never read. Under
`tiled_experts_within(nbytes)` the experts made are kept to about that many bytes (one layer's always whole):
the least recently made, of other layers, are let go and made again when chosen (the quantization report's
forward, which would otherwise tile every expert of the model, holds one layer's at a time)."""
from __future__ import annotations

import contextlib
import ctypes
import sys
from collections import OrderedDict

import torch

from . import native
from .fused import CProduct, c_product, products

_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
MAKE_EXPERT = ctypes.CFUNCTYPE(_I, _L, _L)


class CExpert(ctypes.Structure):  # decode_step.h's qlite_expert
    _fields_ = [("gate_up", CProduct * 2), ("down", CProduct), ("n_gate_up", _I)]


class CMoe(ctypes.Structure):  # decode_step.h's qlite_moe
    _fields_ = [("router", CProduct), ("experts", _P), ("n_experts", _L), ("layer", _L), ("per_token", _I),
                ("norm_topk", _I), ("shared", _P), ("shared_gate", CProduct), ("make", MAKE_EXPERT)]


def c_expert(expert) -> CExpert:
    """An expert's (a SwiGLU MLP of decoder/mlp.py) products as the C side takes them (a deferred kernel makes
    its buffers here)."""
    gate_up = products(expert.gate_up_proj)
    row = CExpert(down=c_product(products(expert.down_proj)[0]), n_gate_up=len(gate_up))
    row.gate_up[:len(gate_up)] = [c_product(p) for p in gate_up]
    return row


def has_product(kernel) -> bool:
    """Whether a kernel runs a native product, without making a deferred one's buffers (its `product` property)."""
    return hasattr(type(kernel), "product") or "product" in vars(kernel) if kernel is not None else False


def runs_natively(expert, hidden: int) -> bool:
    """Whether an expert's linears have native products of widths the C side takes, without making a deferred
    kernel's buffers."""
    parts = [*(expert.gate_up_proj.values() if hasattr(expert.gate_up_proj, "values") else [expert.gate_up_proj]),
             expert.down_proj]
    if len(parts) > 3 or any(not has_product(p.kernel) or getattr(p, "input_order", None) is not None for p in parts):
        return False
    inter = sum(p.out_features for p in parts[:-1]) // 2
    return (all(p.in_features == hidden for p in parts[:-1]) and (parts[-1].out_features, parts[-1].in_features)
            == (hidden, inter) and inter % 32 == 0)


class TiledExperts:
    """Under a budget, the experts made (their kernels' buffers: tiled codes, ...), oldest first, and the bytes
    they hold; making one lets go of the oldest of other layers until the rest fit."""

    def __init__(self):
        self.made: OrderedDict[tuple[NativeSparseMLP, int], int] = OrderedDict()
        self.budget: int | None = None

    def add(self, mlp: NativeSparseMLP, e: int, nbytes: int) -> None:
        if self.budget is None:  # kept for the model's life, as its other layers' buffers are
            return
        self.made[(mlp, e)] = nbytes
        held = sum(self.made.values())
        for key in [k for k in self.made if k[0] is not mlp]:  # C may be using this layer's other experts
            if held <= self.budget:
                break
            held -= self.made.pop(key)
            key[0].let_go(key[1])


TILED = TiledExperts()


@contextlib.contextmanager
def tiled_experts_within(nbytes: int):
    """Experts made while inside keep to about nbytes (see the module docstring); on leaving, every expert
    made inside is let go (the model may live on: they are made again when chosen)."""
    before, TILED.budget = TILED.budget, nbytes
    try:
        yield
    finally:
        TILED.budget = before
        for mlp, e in list(TILED.made):
            mlp.let_go(e)
        TILED.made.clear()


def expert_kernels(expert) -> list:
    parts = expert.gate_up_proj.values() if hasattr(expert.gate_up_proj, "values") else [expert.gate_up_proj]
    return [p.kernel for p in (*parts, expert.down_proj)]


class NativeSparseMLP:
    """One SparseMLP's C description, made once the layer's kernels are set; call it with bf16 tokens."""

    def __init__(self, mlp, hidden: int):
        self.mlp, self.hidden = mlp, hidden
        self.experts = (CExpert * len(mlp.experts))()
        for e, expert in enumerate(mlp.experts):
            if not getattr(expert.down_proj.kernel, "deferred", False):
                self.experts[e] = c_expert(expert)
        self.make = MAKE_EXPERT(self._make)  # kept: C holds its address
        self.shared = c_expert(mlp.shared_expert) if hasattr(mlp, "shared_expert") else None
        self.struct = CMoe(router=c_product(mlp.gate.kernel.product), experts=ctypes.addressof(self.experts),
                           n_experts=len(mlp.experts), per_token=mlp.per_token, norm_topk=int(mlp.norm_topk_prob),
                           shared=None if self.shared is None else ctypes.addressof(self.shared),
                           shared_gate=CProduct() if self.shared is None else c_product(mlp.shared_expert_gate.kernel.product),
                           make=self.make)

    @classmethod
    def build(cls, mlp, hidden: int) -> NativeSparseMLP | None:
        """The C description of a sparse MLP whose router, gates and experts all run natively, else None."""
        bf16 = [mlp.gate] + ([mlp.shared_expert_gate] if hasattr(mlp, "shared_expert") else [])
        experts = list(mlp.experts) + ([mlp.shared_expert] if hasattr(mlp, "shared_expert") else [])
        if (native.library() is None or not hasattr(native.library(), "qlite_sparse_mlp")
                or any(not has_product(g.kernel) or g.kernel.exact_rows != sys.maxsize for g in bf16)
                or not all(runs_natively(e, hidden) for e in experts)):
            return None
        return cls(mlp, hidden)

    def _make(self, layer: int, e: int) -> int:
        try:
            self.experts[e] = c_expert(self.mlp.experts[e])
            TILED.add(self, e, sum(t.nbytes for k in expert_kernels(self.mlp.experts[e])
                                   for t in k.stored.values() if isinstance(t, torch.Tensor)))
            return 0
        except Exception:  # reported by the caller: C returns -1
            return 1

    def let_go(self, e: int) -> None:
        """Expert e back to not made: C makes it again when a token chooses it (never while C runs this layer)."""
        self.experts[e] = CExpert()
        for kernel in expert_kernels(self.mlp.experts[e]):
            kernel.unbuild()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (N, hidden) bf16 rows (normed) -> the sparse MLP's output (N, hidden)."""
        x = x.contiguous()
        native._check(x, torch.bfloat16, (x.shape[0], self.hidden), "x")
        out = torch.empty_like(x)
        rc = native.library().qlite_sparse_mlp(ctypes.addressof(self.struct), x.data_ptr(), x.shape[0], self.hidden,
                                               out.data_ptr(), torch.get_num_threads())
        if rc:
            raise RuntimeError("native sparse MLP: an expert's kernel could not be made")
        return out
