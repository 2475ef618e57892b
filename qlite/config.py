"""The model config read from a checkpoint's config.json, validated; what its model type changes is
the type's Architecture (arch/)."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

from .errors import QliteError
from .fields import field_of, is_int
from .files import read_json
from .arch.moe import Experts
from .qconfig import QuantConfig


@dataclass(frozen=True)
class ModelConfig:
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
    model_type: str = "qwen2"
    attention_bias: bool = True  # q/k/v with bias
    output_bias: bool = False  # o_proj with bias
    explicit_head_dim: int | None = None  # config.json's head_dim (else hidden_size / heads)
    rope_scaling: tuple | None = None  # (key, value) items, checked by the architecture
    experts: Experts | None = None  # a mixture of experts' sparse layers (None: every MLP dense)

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden_size // self.num_attention_heads

    def mlp_modules(self, layer: int) -> list[tuple[str, int]]:
        """(checkpoint name prefix, intermediate width) of each SwiGLU of layer's MLP: the dense one, or
        every expert's then the shared expert's."""
        prefix, e = f"model.layers.{layer}.mlp.", self.experts
        if e is None or not e.sparse(layer):
            return [(prefix, self.intermediate_size)]
        shared = [(f"{prefix}shared_expert.", e.shared_width)] if e.shared_width else []
        return [(f"{prefix}experts.{i}.", e.width) for i in range(e.count)] + shared

    @property
    def token_mlp_width(self) -> int:
        """The most intermediate values one token's MLP makes in any layer (a sparse layer's: its k
        experts' and the shared expert's)."""
        e = self.experts
        sparse = 0 if e is None else e.per_token * e.width + e.shared_width
        dense = any(e is None or not e.sparse(i) for i in range(self.num_hidden_layers))
        return max(sparse, self.intermediate_size if dense else 0)

    @property
    def context_length(self) -> int:
        """The longest context the model runs: max_position_embeddings, or with a rope scaling that
        stretches it (linear, YaRN, dynamic NTK) factor x the context it scales from, as vLLM derives it
        (Llama 3.1's configs already give the stretched one)."""
        scaling = dict(self.rope_scaling or ())
        if scaling.get("rope_type") not in ("linear", "yarn", "dynamic"):
            return self.max_position_embeddings
        original = scaling.get("original_max_position_embeddings") or self.max_position_embeddings
        return max(self.max_position_embeddings, int(scaling["factor"] * original))

    @property
    def arch(self):
        from .arch import architecture
        return architecture(self.model_type, "config")

    @classmethod
    def from_dict(cls, d: dict, source: str = "config.json") -> "ModelConfig":
        """Fields strictly typed (no coercion: "64", 64.7 or "false" are refused, naming the field);
        every field checked against the type's table (arch/config_fields.py): one qlite does not
        know, or a value it does not run (a sliding window, another activation), refused by name."""
        from .arch import architecture
        arch = architecture(d.get("model_type"), source)
        required = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"]
        missing = [k for k in required if k not in d]
        if missing:
            raise QliteError(f"{source}: missing {', '.join(missing)}")
        arch.check_fields(d, source)
        rope = field_of(d, "rope_parameters", dict, source, {})
        rope_theta = d["rope_theta"] if d.get("rope_theta") is not None else rope.get("rope_theta", arch.rope_theta)
        scaling = field_of(d, "rope_scaling", dict, source, None) or {k: v for k, v in rope.items() if k != "rope_theta"}
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        if not all(is_int(e) for e in eos_ids):
            raise QliteError(f"{source}: eos_token_id must be an integer or a list of integers, got {eos!r}")
        heads = field_of(d, "num_attention_heads", int, source)
        cfg = cls(
            vocab_size=field_of(d, "vocab_size", int, source),
            hidden_size=field_of(d, "hidden_size", int, source),
            intermediate_size=field_of(d, "intermediate_size", int, source),
            num_hidden_layers=field_of(d, "num_hidden_layers", int, source),
            num_attention_heads=heads,
            num_key_value_heads=field_of(d, "num_key_value_heads", int, source, heads),
            max_position_embeddings=field_of(d, "max_position_embeddings", int, source, 32768),
            rope_theta=field_of({"rope_theta": rope_theta}, "rope_theta", float, source),
            rms_norm_eps=field_of(d, "rms_norm_eps", float, source, 1e-6),
            tie_word_embeddings=field_of(d, "tie_word_embeddings", bool, source, False),
            eos_token_ids=eos_ids,
            bos_token_id=field_of(d, "bos_token_id", int, source, None),
            torch_dtype=field_of(d, "torch_dtype", str, source, None) or field_of(d, "dtype", str, source, None),
            model_type=arch.model_type,
            attention_bias=arch.attention_bias(d, source),
            output_bias=arch.qkv_bias is None and arch.attention_bias(d, source),
            explicit_head_dim=field_of(d, "head_dim", int, source, None),
            rope_scaling=arch.rope_scaling(scaling, d, source) if scaling else None,
            experts=arch.experts(d, source),
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
        if self.explicit_head_dim is not None and self.explicit_head_dim <= 0:
            raise QliteError(f"{source}: head_dim must be positive, got {self.explicit_head_dim}")
        if self.explicit_head_dim is None and self.hidden_size % self.num_attention_heads:
            raise QliteError(f"{source}: hidden_size {self.hidden_size} is not divisible by "
                             f"num_attention_heads {self.num_attention_heads}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise QliteError(f"{source}: num_attention_heads {self.num_attention_heads} is not divisible by "
                             f"num_key_value_heads {self.num_key_value_heads}")
        if not (math.isfinite(self.rope_theta) and self.rope_theta > 0):
            raise QliteError(f"{source}: rope_theta must be a positive number, got {self.rope_theta}")
        if not (math.isfinite(self.rms_norm_eps) and self.rms_norm_eps > 0):
            raise QliteError(f"{source}: rms_norm_eps must be a small positive number, got {self.rms_norm_eps}")
        if self.experts is not None:
            e = self.experts
            for name, value in (("num_experts", e.count), ("num_experts_per_tok", e.per_token),
                                ("moe_intermediate_size", e.width), ("decoder_sparse_step", e.sparse_step)):
                if value <= 0:
                    raise QliteError(f"{source}: {name} must be positive, got {value}")
            if e.per_token > e.count:
                raise QliteError(f"{source}: num_experts_per_tok {e.per_token} is more than num_experts {e.count}")
            if e.shared_width < 0:
                raise QliteError(f"{source}: shared_expert_intermediate_size must not be negative, got {e.shared_width}")
        if self.head_dim % 2:
            raise QliteError(f"{source}: head_dim {self.head_dim} must be even for RoPE")


def load_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise QliteError(f"{model_dir}: not a directory")
    return ModelConfig.from_dict(read_json(path, within=model_dir), source=str(path))
