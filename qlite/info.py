"""`qlite info`: what a checkpoint dir holds, read from config and safetensors headers only."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

from .checkpoint import CheckpointDir
from .errors import QliteError
from .files import read_json
from .qconfig import DECODER_MODULE

REPORT_NAME = "quantization_report.json"  # written by quantize/report.py


def decoder_linear_part(name: str) -> bool:
    """Whether a tensor is stored weight of a decoder linear (codes, scales, zero points; not a bias)."""
    module, _, suffix = name.rpartition(".")
    m = DECODER_MODULE.fullmatch(module)
    return m is not None and m[1].endswith("_proj") and suffix != "bias"


def decoder_linear_bits_per_weight(ckpt: CheckpointDir) -> float:
    """Stored bits (codes, scales, zero points; not biases) per weight of the decoder's linears."""
    cfg = ckpt.config
    h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    weights = sum(2 * h * q + 2 * h * kv + sum(3 * h * width for _, width in cfg.mlp_modules(layer))
                  for layer in range(cfg.num_hidden_layers))
    stored = sum(t.nbytes for name, t in ckpt.tensors.items() if decoder_linear_part(name))
    return 8 * stored / weights


def rope_scaling(cfg) -> str:
    """ (yarn x4 from 32768), or nothing for a config without rope scaling."""
    s = dict(cfg.rope_scaling or ())
    if not s:
        return ""
    original = s.get("original_max_position_embeddings") or s.get("max_position_embeddings")
    return f" ({s['rope_type']} x{s['factor']:g}{f' from {original}' if original else ''})"


def experts(cfg) -> str:
    """ , experts 128 x 768 (8 per token, ...), or nothing for a dense model."""
    e = cfg.experts
    if e is None:
        return ""
    sparse = sum(e.sparse(i) for i in range(cfg.num_hidden_layers))
    shared = f", shared expert {e.shared_width}" if e.shared_width else ""
    return (f", experts {e.count} x {e.width} ({e.per_token} per token{shared}) in {sparse} of "
            f"{cfg.num_hidden_layers} layers")


def logical_parameters(cfg) -> int:
    """Parameters of the 16-bit model the config describes (whatever the storage format; a tied table
    once): the decoder's own, built on the meta device."""
    import dataclasses

    import torch

    from .decoder.causal_lm import CausalLM

    with torch.device("meta"):
        model = CausalLM(dataclasses.replace(cfg, quantization=None))
    return sum(p.numel() for p in model.parameters())


def format_name(cfg) -> str:
    if cfg.quantization is None:
        return (cfg.torch_dtype or "16-bit").replace("float", "fp").replace("bfp16", "bf16")
    return cfg.quantization.describe()


def describe(model_dir: str | Path) -> str:
    ckpt = CheckpointDir(model_dir)
    cfg = ckpt.config
    by_dtype = Counter()
    for t in ckpt.tensors.values():
        by_dtype[t.dtype] += t.nbytes
    params = logical_parameters(cfg)
    total = sum(by_dtype.values())
    lines = [
        f"checkpoint     {ckpt.path}",
        f"architecture   {cfg.model_type}, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
        f"mlp {cfg.intermediate_size}, heads {cfg.num_attention_heads} (kv {cfg.num_key_value_heads}), "
        f"head_dim {cfg.head_dim}{experts(cfg)}",
        f"vocab          {cfg.vocab_size}, context {cfg.context_length}{rope_scaling(cfg)}, rope_theta {cfg.rope_theta:g}, "
        f"tied embeddings {'yes' if cfg.tie_word_embeddings else 'no'}",
        f"parameters     {params:,} ({params / 1e9:.3f} B)",
        f"tensor bytes   {total:,} ({total / 2**20:.1f} MiB), {8 * total / params:.2f} bits per parameter",
    ]
    for dtype, b in sorted(by_dtype.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {dtype:<6} {b:>16,} bytes")
    lines.append(f"format         {format_name(cfg)}")
    lines.append(f"decoder linears {decoder_linear_bits_per_weight(ckpt):.3f} bits per weight")
    report = ckpt.path / REPORT_NAME
    if report.exists() or report.is_symlink():
        lines += report_lines(report, ckpt.path)
    return "\n".join(lines)


def memory_lines(model_dir: str | Path, tokens: int, batch: int, kv_cache: str, dtype: str) -> str:
    """`qlite info --ctx`: what a run of batch x tokens needs, and the longest context that fits here."""
    import torch

    from . import fit
    from .kv_quant import KINDS
    from .loader import resolve_dtype

    ckpt = CheckpointDir(model_dir)
    run_dtype, bits = resolve_dtype(dtype, torch.device("cpu")), KINDS[kv_cache]
    context = ckpt.config.context_length
    needed = fit.need(ckpt, min(tokens, context), batch, bits, run_dtype)
    rows = f"{batch} x " if batch > 1 else ""
    lines = [f"memory         {rows}{min(tokens, context)} tokens, KV cache {kv_cache}: {needed.describe()}"]
    if tokens > context:
        lines[0] += f" (the model's context is {context})"
    available = fit.available_here()
    if available is None:
        return "\n".join(lines + ["fits here      unknown (no /proc/meminfo)"])
    longest = fit.longest_context(ckpt, available, batch, bits, run_dtype)
    verdict = "yes" if needed.total <= available else "no"
    lines.append(f"fits here      {verdict}: {fit.size_text(available)} available; the longest context that fits is "
                 f"{longest} tokens{f' (the whole {context})' if longest == context else ''}")
    return "\n".join(lines)


def report_lines(path: Path, model_dir: Path) -> list[str]:
    """The quantization report's recipe and fidelity, as `qlite info` prints them."""
    try:
        report = read_json(path, within=model_dir)
        formats = Counter(report["recipe"].values())
        lines = ["recipe         " + ", ".join(f"{fmt} x {n}" for fmt, n in formats.most_common())]
        fidelity = report["fidelity"]
        if fidelity is None:
            return lines + [f"fidelity       not measured ({report.get('not_measured') or '--no-report'})"]
        for text, m in fidelity["texts"].items():
            lines.append(f"{text + ' text':<14} KLD {m['kld_mean']:.4f} ± {m['kld_mean_err']:.4f} (p99 {m['kld_p99']:.3f}), "
                         f"top-1 {100 * m['top1']:.1f}%, PPL ratio {m['ppl_ratio']:.3f} ± {m['ppl_ratio_err']:.3f} "
                         f"({m['tokens']} tokens, measured at quantize time)")
        return lines
    except QliteError as e:
        return [f"report         {e}"]
    except (ValueError, KeyError, TypeError, AttributeError):
        return [f"report         {path}: unreadable (not a qlite quantization report)"]
