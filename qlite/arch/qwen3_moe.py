"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B-A3B): Qwen3's decoder (per-head q/k norms, no
bias) whose MLPs are sparse (moe.py), no shared expert."""
from . import moe
from .qwen3 import Qwen3


class Qwen3Moe(moe.MixtureOfExperts, Qwen3):
    model_type, hf_class, gguf_arch = "qwen3_moe", "Qwen3MoeForCausalLM", "qwen3moe"
    llama_cpp_renormalizes = True
    gguf_names = Qwen3.gguf_names + moe.GGUF_NAMES
    config_fields = {**Qwen3.config_fields, **moe.FIELDS}
