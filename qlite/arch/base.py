"""What a model type changes about the decoder, its config and its files: one Architecture subclass per
type (qwen2.py, ...), registered by config.json's `model_type`. The decoder (decoder/), the config
parser (config.py), the GGUF reader and writer and `qlite info` ask it; nothing else names a type."""
from __future__ import annotations

from typing import ClassVar

import torch

from ..errors import QliteError
from . import rope
from .config_fields import COMMON, check_fields

ARCHITECTURES: dict[str, "Architecture"] = {}

# llama.cpp's names for the tensors every type here has: (GGUF name pattern, HF name template)
GGUF_COMMON = (
    (r"token_embd\.weight", "model.embed_tokens.weight"),
    (r"output_norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (r"blk\.(\d+)\.attn_norm\.weight", "model.layers.{}.input_layernorm.weight"),
    (r"blk\.(\d+)\.ffn_norm\.weight", "model.layers.{}.post_attention_layernorm.weight"),
    (r"blk\.(\d+)\.attn_q\.(weight|bias)", "model.layers.{}.self_attn.q_proj.{}"),
    (r"blk\.(\d+)\.attn_k\.(weight|bias)", "model.layers.{}.self_attn.k_proj.{}"),
    (r"blk\.(\d+)\.attn_v\.(weight|bias)", "model.layers.{}.self_attn.v_proj.{}"),
    (r"blk\.(\d+)\.attn_output\.weight", "model.layers.{}.self_attn.o_proj.weight"),
    (r"blk\.(\d+)\.ffn_gate\.weight", "model.layers.{}.mlp.gate_proj.weight"),
    (r"blk\.(\d+)\.ffn_up\.weight", "model.layers.{}.mlp.up_proj.weight"),
    (r"blk\.(\d+)\.ffn_down\.weight", "model.layers.{}.mlp.down_proj.weight"),
)
# the byte-level BPE pre-tokenizer split of Qwen's tokenizers (digits one at a time)
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")


class Architecture:
    """A decoder of the Llama lineage: embedding -> N x [x + attn(norm(x)); x + SwiGLU(norm(x))] -> norm
    -> lm_head, grouped-query attention with rotary embeddings (half rotation). A type says what differs."""
    model_type: ClassVar[str]
    hf_class: ClassVar[str]  # config.json's "architectures" entry
    # q/k/v bias fixed (o_proj then has none: Qwen2), or None: the config's `attention_bias` (default False),
    # which o_proj follows too (transformers' Llama, Qwen3)
    qkv_bias: ClassVar[bool | None] = None
    qk_norm: ClassVar[bool] = False  # RMSNorm over each head of q and k before the rotation (Qwen3)
    rope_theta: ClassVar[float] = 10000.0  # when the config gives none
    gguf_arch: ClassVar[str]  # llama.cpp's architecture name (its metadata keys' prefix)
    gguf_names: ClassVar[tuple] = GGUF_COMMON
    gguf_split: ClassVar[str] = QWEN_SPLIT  # the tokenizer's pre-split, for a GGUF's BPE vocabulary
    gguf_pre: ClassVar[str] = "qwen2"  # llama.cpp's name for that pre-tokenizer (tokenizer.ggml.pre)
    gguf_bos: ClassVar[int | None] = None  # bos token id when a GGUF gives none
    tokenizer_class: ClassVar[str] = "PreTrainedTokenizerFast"  # tokenizer_config.json's, for an imported GGUF

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        ARCHITECTURES[cls.model_type] = cls()

    # config.json fields this type reads, accepts at some values or ignores, beyond COMMON's (config_fields.py)
    config_fields: ClassVar[dict] = {}

    def check_fields(self, d: dict, source: str) -> None:
        """Refuse a config.json field this type does not know, or a value it does not run."""
        check_fields(d, {**COMMON, **self.config_fields}, self.model_type, source)

    def attention_bias(self, d: dict, source: str) -> bool:
        from ..fields import field_of
        return self.qkv_bias if self.qkv_bias is not None else field_of(d, "attention_bias", bool, source, False)

    def experts(self, d: dict, source: str):
        """The config's mixture of experts (moe.Experts), or None: every MLP dense (moe.py's types say otherwise)."""
        return None

    rope_scalings: ClassVar[tuple[str, ...]] = ()  # the rope scalings it accepts (rope.py), others refused

    def rope_scaling(self, scaling: dict, d: dict, source: str) -> tuple | None:
        """The config's rope scaling ({"rope_type": ..., ...} without rope_theta; d: the whole config),
        checked, as a tuple of items (None: none)."""
        return rope.checked(scaling, self.rope_scalings, d, self.model_type, source)

    def rope(self, cfg) -> tuple[torch.Tensor, float]:
        """The rotary inverse frequencies (head_dim / 2,), float32, and the factor on cos and sin."""
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device="cpu").float() / cfg.head_dim)
        return rope.scaled(inv_freq, cfg.rope_scaling, cfg.head_dim, cfg.rope_theta)

    def gguf_metadata(self, cfg, where: str) -> dict:
        """llama.cpp's metadata keys (without the `gguf_arch.` prefix) this type adds to a GGUF export."""
        return {}

    def gguf_config(self, field) -> dict:
        """config.json fields this type reads from a GGUF's metadata (field(key): the value of `gguf_arch.key`, or None)."""
        return {}

    def gguf_rows(self, name: str, rows: int, n_head: int, n_kv: int) -> torch.Tensor | None:
        """Where llama.cpp's converter reorders a tensor's rows (HF name): GGUF row i is HF row order[i];
        None: as they are."""
        return None


def architecture(model_type, source: str) -> Architecture:
    arch = ARCHITECTURES.get(model_type) if isinstance(model_type, str) else None
    if arch is None:
        raise QliteError(f"{source}: model_type is {model_type!r}, qlite runs {', '.join(map(repr, ARCHITECTURES))}")
    return arch

