"""The decoder, by job: linear.py (linears, fused projections), ops.py (what a forward's layers share and
the reference small ops), kv_cache.py (the cache's storage), layers.py (norm, rotary, attention, one
layer), mlp.py (the dense MLP and a mixture of experts' sparse one), causal_lm.py (the whole model and its forward),
names.py (checkpoint names of the model's tensors).

References: HF transformers' modeling_qwen2 / qwen3 / llama / qwen2_moe / qwen3_moe, which the tests use
as the reference."""
from .causal_lm import CausalLM, Decoder  # noqa: F401
