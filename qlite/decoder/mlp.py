"""The MLPs: the dense SwiGLU, and a mixture of experts' sparse one (a router choosing each token's k
experts, each a SwiGLU of its own, their outputs summed with the router's weights; Qwen2-MoE adds a shared
expert every token takes). Reference: transformers' Qwen2MoeSparseMoeBlock / Qwen3MoeSparseMoeBlock."""
from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from .linear import Linear, make_linear
from .ops import TorchOps


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up as one `gate_up_proj`, of `width` (the checkpoint's
    modules prefix + gate_proj / up_proj / down_proj: a dense layer's, an expert's)."""
    ops = TorchOps

    def __init__(self, cfg: ModelConfig, prefix: str, width: int):
        super().__init__()
        self.gate_up_proj = make_linear(cfg, prefix, cfg.hidden_size, {"gate_proj": width, "up_proj": width}, bias=False)
        self.down_proj = make_linear(cfg, prefix, width, {"down_proj": cfg.hidden_size}, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_mul(self.gate_up_proj(x)))


class SparseMLP(nn.Module):
    """Each token through the k experts the router (`gate`, kept 16-bit: E x hidden, a sliver of the
    layer) rates highest, their outputs weighted by the router's softmax (renormalized over the k where the
    config says), plus the shared expert's under a sigmoid gate. The tokens are grouped by expert, one
    product per expert over its tokens; an expert no token chose is never read (a mapped checkpoint
    never pages it in). Checkpoint names: prefix + gate, experts.E.{gate,up,down}_proj, shared_expert.*,
    shared_expert_gate, as transformers saves them."""
    ops = TorchOps

    def __init__(self, cfg: ModelConfig, prefix: str):
        super().__init__()
        e = cfg.experts
        self.per_token, self.norm_topk_prob = e.per_token, e.norm_topk_prob
        self.gate = Linear(cfg.hidden_size, e.count, bias=False)
        self.gate.row_exact = True  # a token's choice the same in a prefill as in a step (kernels.NativeBf16)
        self.experts = nn.ModuleList(MLP(cfg, f"{prefix}experts.{i}.", e.width) for i in range(e.count))
        if e.shared_width:
            self.shared_expert = MLP(cfg, f"{prefix}shared_expert.", e.shared_width)
            self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False)
            self.shared_expert_gate.row_exact = True

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For tokens x (N, hidden): the chosen experts (N, k) and their weights (N, k) in x's dtype."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # (N, experts)
        weights, chosen = probs.topk(self.per_token, dim=-1)  # (N, k) each
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return chosen, weights.to(x.dtype)

    def groups(self, chosen: torch.Tensor):
        """For the chosen experts (N, k): each expert some token chose, ascending, with its tokens (n,)
        and their (token, slot) pairs' flat indices (n,) into (N, k)."""
        slots = chosen.reshape(-1).argsort(stable=True)  # (N * k,) the (token, slot) pairs grouped by expert
        counts = torch.bincount(chosen.reshape(-1), minlength=len(self.experts)).tolist()
        start = 0
        for expert, n in enumerate(counts):
            if n:
                mine = slots[start:start + n]
                yield expert, mine // self.per_token, mine
            start += n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.sparse_mlp(self, x)
