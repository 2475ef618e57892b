"""qlite: quantized, low-memory inference for Qwen2-family models.

    import qlite
    lm = qlite.load("ckpt-dir")            # 16-bit or quantized checkpoint dir
    print(lm.generate("Write a haiku about memory."))

Importing qlite is light (torch is imported by what needs it), so the `qlite` command starts fast
and a Ctrl-C during its start-up is handled by the command like any other.
"""
from .errors import QliteError

__all__ = ["QliteError", "SamplingParams", "TextModel", "load"]
__version__ = "0.1.0"
_LAZY = {"SamplingParams": "generate", "TextModel": "pipeline", "load": "pipeline"}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'qlite' has no attribute {name!r}")
