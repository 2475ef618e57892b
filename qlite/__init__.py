"""qlite: quantized, low-memory inference for Qwen2-family models.

    import qlite
    lm = qlite.load("ckpt-dir")            # 16-bit or quantized checkpoint dir
    print(lm.generate("Write a haiku about memory."))
"""
from .errors import QliteError
from .generate import SamplingParams
from .pipeline import TextModel, load

__all__ = ["QliteError", "SamplingParams", "TextModel", "load"]
__version__ = "0.1.0"
