"""`qlite info`: what a checkpoint dir holds, read from config and safetensors headers only."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

from .config import load_config
from .errors import QliteError
from .safetensors_io import checkpoint_files


def tensor_table(model_dir: Path) -> tuple[Counter, Counter]:
    """(bytes by dtype, element count by dtype) over every tensor, reading headers only."""
    from safetensors import SafetensorError, safe_open

    nbytes, numel = Counter(), Counter()
    for path in checkpoint_files(model_dir):
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    sl = f.get_slice(name)
                    count = 1
                    for d in sl.get_shape():
                        count *= d
                    dtype = sl.get_dtype()
                    numel[dtype] += count
                    nbytes[dtype] += count * {"F64": 8, "F32": 4, "I32": 4, "I64": 8, "F16": 2, "BF16": 2,
                                              "I16": 2}.get(dtype, 1)
        except SafetensorError as e:
            raise QliteError(f"{path}: unreadable safetensors file ({e})") from None
    return nbytes, numel


def logical_parameters(cfg) -> int:
    """Parameters of the 16-bit model the config describes (whatever the storage format)."""
    h, i, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_key_value_heads * cfg.head_dim
    per_layer = (h * h + h) + 2 * (h * kv + kv) + h * h + 3 * h * i + 2 * h
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * h
    return cfg.vocab_size * h + cfg.num_hidden_layers * per_layer + h + head


def describe(model_dir: str | Path) -> str:
    model_dir = Path(model_dir)
    cfg = load_config(model_dir)
    nbytes, _ = tensor_table(model_dir)
    params = logical_parameters(cfg)
    total = sum(nbytes.values())
    lines = [
        f"checkpoint     {model_dir}",
        f"architecture   qwen2, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
        f"mlp {cfg.intermediate_size}, heads {cfg.num_attention_heads} (kv {cfg.num_key_value_heads}), "
        f"head_dim {cfg.head_dim}",
        f"vocab          {cfg.vocab_size}, context {cfg.max_position_embeddings}, rope_theta {cfg.rope_theta:g}, "
        f"tied embeddings {'yes' if cfg.tie_word_embeddings else 'no'}",
        f"parameters     {params:,} ({params / 1e9:.3f} B)",
        f"tensor bytes   {total:,} ({total / 2**20:.1f} MiB), {8 * total / params:.2f} bits per parameter",
    ]
    for dtype, b in sorted(nbytes.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {dtype:<6} {b:>16,} bytes")
    q = cfg.quantization_config
    if q:
        from .formats import describe_quantization
        lines.append(f"quantization   {describe_quantization(q)}")
    else:
        lines.append("quantization   none")
    return "\n".join(lines)
