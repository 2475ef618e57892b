"""What the mixtures of experts (qwen2_moe, qwen3_moe) share: their config fields, read into `Experts`, and
llama.cpp's GGUF names and keys for them."""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import QliteError
from ..fields import field_of, is_int
from .config_fields import Ignored, Read


@dataclass(frozen=True)
class Experts:
    """A mixture of experts' sparse MLP (Qwen2-MoE, Qwen3-MoE): `count` SwiGLU experts of `width`, the
    router's `per_token` best each token (their softmax weights renormalized to sum 1 when
    `norm_topk_prob`), plus, where `shared_width` > 0, a shared expert every token takes, weighted by a
    sigmoid gate. Layer i is sparse when it is not among `dense_layers` and (i + 1) % `sparse_step` == 0;
    the dense ones have the config's intermediate_size MLP."""
    count: int
    per_token: int
    width: int
    norm_topk_prob: bool = False
    shared_width: int = 0
    sparse_step: int = 1
    dense_layers: tuple[int, ...] = ()

    def sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers and (layer + 1) % self.sparse_step == 0


TRAINING = Ignored("the router's auxiliary loss in training: no effect on a forward pass")
FIELDS = {
    "num_experts": Read("experts in each sparse layer"),
    "num_local_experts": Read("num_experts under transformers 5's name for it (Qwen3-MoE)"),
    "num_experts_per_tok": Read("experts each token takes (top k of the router's softmax)"),
    "moe_intermediate_size": Read("each expert's MLP width"),
    "norm_topk_prob": Read("whether the k chosen weights are renormalized to sum 1"),
    "decoder_sparse_step": Read("every step-th layer is sparse"),
    "mlp_only_layers": Read("layers with a dense MLP among sparse ones"),
    "output_router_logits": TRAINING,
    "router_aux_loss_coef": TRAINING,
}


def experts(d: dict, source: str, shared: bool) -> Experts:
    """Experts from a MoE config (shared: the type has Qwen2-MoE's shared expert)."""
    dense = d.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(is_int(i) for i in dense):
        raise QliteError(f"{source}: mlp_only_layers must be a list of layer numbers, got {dense!r}"[:300])
    count = field_of(d, "num_experts", int, source, None)
    local = field_of(d, "num_local_experts", int, source, None)
    if count is not None and local is not None and count != local:
        raise QliteError(f"{source}: num_experts {count} and num_local_experts {local} disagree")
    if count is None and local is None:
        raise QliteError(f"{source}: num_experts is missing")
    return Experts(count=local if count is None else count, per_token=field_of(d, "num_experts_per_tok", int, source),
                   width=field_of(d, "moe_intermediate_size", int, source),
                   norm_topk_prob=field_of(d, "norm_topk_prob", bool, source, False),
                   shared_width=field_of(d, "shared_expert_intermediate_size", int, source, 0) if shared else 0,
                   sparse_step=field_of(d, "decoder_sparse_step", int, source, 1), dense_layers=tuple(dense))


# llama.cpp's names: the router, the experts of a layer merged into one 3-D tensor each (expert, rows, columns;
# the HF side a name without the expert's number, as llama.cpp's converter names the stack), the shared expert
GGUF_NAMES = (
    (r"blk\.(\d+)\.ffn_gate_inp\.weight", "model.layers.{}.mlp.gate.weight"),
    (r"blk\.(\d+)\.ffn_gate_exps\.weight", "model.layers.{}.mlp.experts.gate_proj.weight"),
    (r"blk\.(\d+)\.ffn_up_exps\.weight", "model.layers.{}.mlp.experts.up_proj.weight"),
    (r"blk\.(\d+)\.ffn_down_exps\.weight", "model.layers.{}.mlp.experts.down_proj.weight"),
)
GGUF_SHARED = (
    (r"blk\.(\d+)\.ffn_gate_inp_shexp\.weight", "model.layers.{}.mlp.shared_expert_gate.weight"),
    (r"blk\.(\d+)\.ffn_gate_shexp\.weight", "model.layers.{}.mlp.shared_expert.gate_proj.weight"),
    (r"blk\.(\d+)\.ffn_up_shexp\.weight", "model.layers.{}.mlp.shared_expert.up_proj.weight"),
    (r"blk\.(\d+)\.ffn_down_shexp\.weight", "model.layers.{}.mlp.shared_expert.down_proj.weight"),
)
EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+_proj)")  # an expert's module; its number


def merged_name(module: str) -> tuple[str, int] | None:
    """An expert's module (model.layers.3.mlp.experts.17.up_proj) -> (the stack's module, model.layers.3.mlp.experts.up_proj;
    17), or None for any other module."""
    m = EXPERT.fullmatch(module)
    return None if m is None else (f"{m[1]}.{m[3]}", int(m[2]))


def gguf_metadata(cfg, where: str) -> dict:
    """The expert keys of llama.cpp's GGUF (without the architecture's prefix) for a config, or an error for
    what llama.cpp's qwen2moe / qwen3moe cannot hold: every layer sparse, the k weights renormalized
    (qwen3moe) or not (qwen2moe), as its graphs fix them."""
    e, renorm = cfg.experts, cfg.arch.llama_cpp_renormalizes
    if any(not e.sparse(i) for i in range(cfg.num_hidden_layers)):
        raise QliteError(f"{where}: dense layers among sparse ones (mlp_only_layers, decoder_sparse_step): llama.cpp's "
                         f"{cfg.arch.gguf_arch} makes every layer sparse (not exported)")
    if e.norm_topk_prob != renorm:
        raise QliteError(f"{where}: norm_topk_prob {str(e.norm_topk_prob).lower()}: llama.cpp's {cfg.arch.gguf_arch} "
                         f"always {'renormalizes' if renorm else 'keeps'} the chosen experts' weights (not exported)")
    keys = {"expert_count": e.count, "expert_used_count": e.per_token, "expert_feed_forward_length": e.width}
    return keys | ({"expert_shared_feed_forward_length": e.shared_width} if e.shared_width else {})


def from_gguf(field, renorm: bool) -> dict:
    """config.json's expert fields from a GGUF's metadata (field(key): the value under the architecture's prefix)."""
    config = {"num_experts": int(field("expert_count")), "num_experts_per_tok": int(field("expert_used_count")),
              "moe_intermediate_size": int(field("expert_feed_forward_length")), "norm_topk_prob": renorm}
    shared = field("expert_shared_feed_forward_length")
    return config | ({"shared_expert_intermediate_size": int(shared)} if shared is not None else {})


class MixtureOfExperts:
    """What a mixture of experts adds to its dense type (listed before it among a type's bases)."""
    shared_expert = False  # Qwen2-MoE's shared expert under a sigmoid gate
    llama_cpp_renormalizes = False  # whether llama.cpp's graph for the type renormalizes the k weights

    def experts(self, d, source):
        return experts(d, source, shared=self.shared_expert)

    def gguf_metadata(self, cfg, where):
        return gguf_metadata(cfg, where)

    def gguf_config(self, field):
        return from_gguf(field, renorm=self.llama_cpp_renormalizes)
