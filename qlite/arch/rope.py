"""Rotary frequency scalings, as transformers computes them (modeling_rope_utils), pure functions: each
takes the unscaled inverse frequencies (head_dim / 2,) and the config's scaling fields, and gives the
scaled ones and the attention factor that multiplies cos and sin (1 but for YaRN). Dynamic NTK depends
on the sequence's length as well (`dynamic_inv_freq`, per row). An architecture says which it accepts
(Architecture.rope_scalings); the rest are refused by name."""
from __future__ import annotations

import math

import torch

from ..errors import QliteError


def linear(inv_freq: torch.Tensor, p: dict, head_dim: int, theta: float) -> tuple[torch.Tensor, float]:
    """Position interpolation: every frequency divided by factor."""
    return inv_freq / p["factor"], 1.0


def llama3(inv_freq, p, head_dim, theta):
    """Llama 3.1's: long wavelengths divided by factor, short ones kept, a smooth blend between."""
    factor, low, high, original = (p[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                                  "original_max_position_embeddings"))
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < original / high) & ~(wavelen > original / low)
    return torch.where(medium, blended, scaled), 1.0


def yarn(inv_freq, p, head_dim, theta):
    """YaRN (Peng et al. 2023): interpolated frequencies below a ramp of dimensions, extrapolated above,
    and cos/sin scaled by 0.1 ln(factor) + 1 (or the config's attention_factor / mscale ratio)."""
    factor, original = p["factor"], p["original_max_position_embeddings"]

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = p.get("attention_factor")
    if attention is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations):  # the dimension whose wavelength makes `rotations` turns in `original`
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(p.get("beta_fast") or 32), correction_dim(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if low == high else high
    dims = torch.arange(head_dim // 2, dtype=torch.float32, device=inv_freq.device)  # (head_dim / 2,)
    ramp = ((dims - low) / (high - low)).clamp(0, 1)
    extrapolated = 1 - ramp
    return (inv_freq / factor) * (1 - extrapolated) + inv_freq * extrapolated, float(attention)


def dynamic(inv_freq, p, head_dim, theta):
    """Dynamic NTK: the unscaled frequencies up to the pretraining context; past it, Rotary computes
    them per row from the row's length (dynamic_inv_freq)."""
    return inv_freq, 1.0


def dynamic_inv_freq(p: dict, head_dim: int, theta: float, seq_len: torch.Tensor) -> torch.Tensor:
    """Dynamic NTK's inverse frequencies (B, head_dim / 2) for rows seq_len (B,) tokens long: the base
    raised as the length passes max_position_embeddings (transformers' _compute_dynamic_ntk_parameters,
    in its float32 order). transformers takes the longest row of a batch and keeps the largest length it
    has seen until one falls back under the context; here each row's own length decides its frequencies,
    so a row's numbers do not depend on its batch (equal to transformers for one sequence)."""
    factor, context = p["factor"], p["max_position_embeddings"]
    seq = seq_len.clamp(min=context).float()[:, None]  # (B, 1)
    base = theta * ((factor * seq / context) - (factor - 1)) ** (head_dim / (head_dim - 2))  # (B, 1)
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=seq.device).float() / head_dim
    return 1.0 / (base ** exponents)  # (B, head_dim / 2)


SCALINGS = {"linear": (linear, ("factor",)), "dynamic": (dynamic, ("factor", "max_position_embeddings")), "yarn": (yarn, ("factor", "original_max_position_embeddings")),
            "llama3": (llama3, ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"))}
OPTIONAL = ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
# what a scaling's numbers may be (transformers refuses a factor under 1; past these bounds a config is
# broken, not long: the angles or the context overflow, or the logits go NaN); others: 0..1e4
RANGES = {"factor": (1, 1024), "attention_factor": (0, 100), "mscale": (0, 100), "mscale_all_dim": (0, 100),
          "original_max_position_embeddings": (1, 2**31 - 1), "max_position_embeddings": (1, 2**31 - 1)}
# fields any rope dict may hold: its type, the base (rope_parameters), the pretraining context (read where a
# scaling uses it; linear's math has none), a rotated fraction (1 only)
KNOWN = ("rope_type", "type", "rope_theta", "original_max_position_embeddings", "partial_rotary_factor")


def checked(scaling: dict, accepted: tuple[str, ...], d: dict, model_type: str, source: str) -> tuple | None:
    """The config's scaling ({"rope_type" or "type": ..., fields}) checked, as sorted (key, value) items;
    None for the default. The pretraining context defaults as transformers' does (the config's
    original_max_position_embeddings, else max_position_embeddings)."""
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if scaling.get("partial_rotary_factor", 1) != 1:
        raise QliteError(f"{source}: rope partial_rotary_factor {scaling['partial_rotary_factor']!r}"[:200] +
                         ": qlite rotates every dimension of a head (1.0) only")
    known = KNOWN + (SCALINGS[kind][1] + OPTIONAL + ("truncate",) if kind in SCALINGS else ())
    unknown = [k for k in scaling if k not in known]
    if unknown and kind in accepted + (None, "default"):
        raise QliteError(f"{source}: rope scaling / rope_parameters field {unknown[0][:80]!r}: qlite does not know "
                         f"what it does to a {kind or 'default'} rotation, so it does not run it")
    if kind in (None, "default"):
        return None
    if kind not in accepted:
        raise QliteError(f"{source}: rope_scaling / rope_parameters type {kind!r}: qlite does not implement it for "
                         f"{model_type} (it has {', '.join(accepted) or 'no rope scaling'}; remove it to run at the "
                         f"original context)")
    p = {k: v for k, v in scaling.items() if k in SCALINGS[kind][1] + OPTIONAL + ("truncate",)}
    if kind == "dynamic":  # transformers scales from the config's context, not an "original" one
        p["max_position_embeddings"] = d.get("max_position_embeddings")
    if "original_max_position_embeddings" in SCALINGS[kind][1]:
        p.setdefault("original_max_position_embeddings",
                     d.get("original_max_position_embeddings") or d.get("max_position_embeddings"))
    for name in SCALINGS[kind][1] + tuple(k for k in OPTIONAL if p.get(k) is not None):
        v = p.get(name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise QliteError(f"{source}: rope scaling {kind} needs a positive {name}, got {v!r}"[:300])
        low, high = RANGES.get(name, (0, 1e4))
        if not low <= v <= high:
            raise QliteError(f"{source}: rope scaling {kind}: {name} {v!r} is outside {low:g}..{high:g}"[:300])
    if kind == "llama3" and p["high_freq_factor"] <= p["low_freq_factor"]:
        raise QliteError(f"{source}: rope scaling llama3: high_freq_factor must exceed low_freq_factor")
    if not isinstance(p.get("truncate", True), bool):
        raise QliteError(f"{source}: rope scaling {kind}: truncate must be true or false")
    return tuple(sorted({"rope_type": kind, **p}.items()))


def scaled(inv_freq: torch.Tensor, scaling: tuple | None, head_dim: int, theta: float) -> tuple[torch.Tensor, float]:
    if scaling is None:
        return inv_freq, 1.0
    p = dict(scaling)
    return SCALINGS[p["rope_type"]][0](inv_freq, p, head_dim, theta)
