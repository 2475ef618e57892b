"""Qwen2 / Qwen2.5: q/k/v with bias (and no other bias), default rope theta 1e6."""
from .base import Architecture
from .config_fields import Ignored


class Qwen2(Architecture):
    model_type, hf_class, gguf_arch = "qwen2", "Qwen2ForCausalLM", "qwen2"
    qkv_bias = True
    rope_theta = 1_000_000.0
    gguf_bos, tokenizer_class = 151643, "Qwen2Tokenizer"
    rope_scalings = ("linear", "yarn", "dynamic")  # Qwen2.5's long-context configs use YaRN
    config_fields = {"attention_bias": Ignored("transformers' Qwen2 gives q/k/v a bias and o_proj none, "
                                               "whatever the field says")}
