"""Model types, one file each, registered by config.json's `model_type` (base.py says what a type decides)."""
from . import llama, qwen2, qwen2_moe, qwen3, qwen3_moe  # noqa: F401  (each model type registers itself on import)
from .base import ARCHITECTURES, Architecture, architecture  # noqa: F401
