"""Qwen3 (dense): no q/k/v bias (the config's attention_bias), q and k RMS-normed per head before the
rotation, head_dim from the config (not hidden_size / heads)."""
from .base import GGUF_COMMON, Architecture


class Qwen3(Architecture):
    model_type, hf_class, gguf_arch = "qwen3", "Qwen3ForCausalLM", "qwen3"
    qk_norm = True
    gguf_bos, tokenizer_class = 151643, "Qwen2Tokenizer"
    rope_scalings = ("linear", "yarn", "dynamic")
    gguf_names = GGUF_COMMON + (
        (r"blk\.(\d+)\.attn_q_norm\.weight", "model.layers.{}.self_attn.q_norm.weight"),
        (r"blk\.(\d+)\.attn_k_norm\.weight", "model.layers.{}.self_attn.k_norm.weight"),
    )
