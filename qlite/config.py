"""Qwen2 model config read from a checkpoint's config.json, validated."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from .errors import QliteError
from .qconfig import QuantConfig


@dataclass(frozen=True)
class Qwen2Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int = 32768
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    torch_dtype: str | None = None
    quantization: QuantConfig | None = None  # None: a 16-bit checkpoint

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, d: dict, source: str = "config.json") -> "Qwen2Config":
        if d.get("model_type") != "qwen2":
            raise QliteError(f"{source}: model_type is {d.get('model_type')!r}, qlite runs only 'qwen2'")
        required = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"]
        missing = [k for k in required if k not in d]
        if missing:
            raise QliteError(f"{source}: missing {', '.join(missing)}")
        rope = d.get("rope_parameters") or {}
        rope_theta = d.get("rope_theta", rope.get("rope_theta", 1_000_000.0))
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        cfg = cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=int(d["num_attention_heads"]),
            num_key_value_heads=int(d.get("num_key_value_heads") or d["num_attention_heads"]),
            max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
            rope_theta=float(rope_theta),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            bos_token_id=d.get("bos_token_id"),
            torch_dtype=d.get("torch_dtype") or d.get("dtype"),
        )
        cfg.validate(source)
        if d.get("quantization_config") is not None:
            cfg = replace(cfg, quantization=QuantConfig.from_dict(d["quantization_config"], source))
        return cfg

    def validate(self, source: str) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise QliteError(f"{source}: {name} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise QliteError(f"{source}: hidden_size {self.hidden_size} is not divisible by "
                             f"num_attention_heads {self.num_attention_heads}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise QliteError(f"{source}: num_attention_heads {self.num_attention_heads} is not divisible by "
                             f"num_key_value_heads {self.num_key_value_heads}")
        if not (math.isfinite(self.rope_theta) and self.rope_theta > 0):
            raise QliteError(f"{source}: rope_theta must be a positive number, got {self.rope_theta}")
        if not (math.isfinite(self.rms_norm_eps) and self.rms_norm_eps > 0):
            raise QliteError(f"{source}: rms_norm_eps must be a small positive number, got {self.rms_norm_eps}")
        if self.head_dim % 2:
            raise QliteError(f"{source}: head_dim {self.head_dim} must be even for RoPE")


def read_text(path: Path) -> str:
    """A small text file of a checkpoint, every failure naming it."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise QliteError(f"{path}: not found") from None
    except UnicodeDecodeError:
        raise QliteError(f"{path}: not UTF-8 text") from None
    except OSError as e:
        raise QliteError(f"{path}: unreadable ({e.strerror})") from None


def read_json(path: Path) -> dict:
    """A JSON object from a file (config, index, tokenizer config), every failure naming the file."""
    try:
        value = json.loads(read_text(path))
    except (json.JSONDecodeError, RecursionError) as e:
        raise QliteError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise QliteError(f"{path}: holds a JSON {type(value).__name__}, not an object")
    return value


def load_config(model_dir: str | Path) -> Qwen2Config:
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise QliteError(f"{model_dir}: not a directory")
    return Qwen2Config.from_dict(read_json(path), source=str(path))
