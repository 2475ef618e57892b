"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's decoder whose MLPs are sparse (moe.py), each with
a shared expert under a sigmoid gate; q/k/v bias from the config's `qkv_bias` (default true), o_proj none."""
from . import moe
from .config_fields import Read
from .qwen2 import Qwen2


class Qwen2Moe(moe.MixtureOfExperts, Qwen2):
    model_type, hf_class, gguf_arch = "qwen2_moe", "Qwen2MoeForCausalLM", "qwen2moe"
    shared_expert = True
    gguf_names = Qwen2.gguf_names + moe.GGUF_NAMES + moe.GGUF_SHARED
    config_fields = {**Qwen2.config_fields, **moe.FIELDS,
                     "qkv_bias": Read("q/k/v with bias (o_proj never)"),
                     "shared_expert_intermediate_size": Read("the shared expert's MLP width")}

    def attention_bias(self, d, source):
        from ..fields import field_of
        return field_of(d, "qkv_bias", bool, source, True)
