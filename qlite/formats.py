"""Quantized formats: the table of formats, int4 packing, dequantization, and which module gets
which format. Pure functions; the quantizer (quantize/) and the runtime share them.

Canonical layout on disk (kernel-independent; kernels repack at load):
  int8:  qweight int8 [N, K], scales fp16 [N, K/G]                      w = q * s
  int4:  qweight uint8 [N, ceil(K/2)] (column 2j in the low nibble, 2j+1 in the high),
         scales fp16 [N, K/G], zeros uint8 [N, K/G] (integer zero points) w = (q - z) * s
G = K (one group per row) means per output channel.
The bitsandbytes peer formats keep bitsandbytes' own layout:
  nf4:      qweight uint8 [N, K/2] (column 2j in the HIGH nibble), absmax fp32 [N, K/64]  w = NF4[q] * absmax
  llm.int8: qweight int8 [N, K], scb fp32 [N] (row absmax)                               w = q * scb / 127
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from .errors import QliteError

FORMAT_VERSION = 1
QUANT_METHOD = "qlite"
LINEAR_KINDS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SCALE_BITS, ZERO_BITS = 16, 8


SCHEMES = ("int", "nf4", "llm.int8")


@dataclass(frozen=True)
class Format:
    bits: int  # 4 or 8
    group_size: int | None  # None: one scale per output channel
    symmetric: bool  # int8 is always symmetric; int4 stores zero points either way (8 when symmetric)
    scheme: str = "int"  # qlite's integer formats, or a bitsandbytes one: "nf4", "llm.int8"

    @property
    def name(self) -> str:
        if self.scheme == "nf4":
            return f"nf4-b{self.group_size}"
        if self.scheme == "llm.int8":
            return "llm.int8"
        if self.bits == 8:
            return "int8" if self.group_size is None else f"int8-g{self.group_size}"
        return f"int4-g{self.group_size}" + ("-sym" if self.symmetric else "")

    def groups(self, in_features: int) -> int:
        return 1 if self.group_size is None else in_features // self.group_size

    def bits_per_weight(self, in_features: int) -> float:
        """Storage bits per weight, scales and zero points included."""
        if self.scheme != "int":  # bitsandbytes keeps float32 absmax per block (nf4) or per row (llm.int8)
            return self.bits + 32 * self.groups(in_features) / in_features
        per_group = SCALE_BITS + (ZERO_BITS if self.bits == 4 else 0)
        return self.bits + per_group * self.groups(in_features) / in_features

    def stored_shapes(self, out_features: int, in_features: int) -> dict[str, tuple[torch.dtype, tuple]]:
        g = self.groups(in_features)
        if self.scheme == "nf4":
            return {"qweight": (torch.uint8, (out_features, in_features // 2)),
                    "absmax": (torch.float32, (out_features, g))}
        if self.scheme == "llm.int8":
            return {"qweight": (torch.int8, (out_features, in_features)), "scb": (torch.float32, (out_features,))}
        if self.bits == 8:
            return {"qweight": (torch.int8, (out_features, in_features)),
                    "scales": (torch.float16, (out_features, g))}
        return {"qweight": (torch.uint8, (out_features, (in_features + 1) // 2)),
                "scales": (torch.float16, (out_features, g)),
                "zeros": (torch.uint8, (out_features, g))}

    def check(self, in_features: int, where: str) -> None:
        if self.group_size is not None and in_features % self.group_size:
            raise QliteError(f"--group-size {self.group_size} does not divide {where}'s input width {in_features}")


def validate_format(bits: int, group_size: int | None, symmetric: bool, scheme: str = "int") -> Format:
    if scheme == "nf4":
        return Format(4, group_size or 64, True, "nf4")
    if scheme == "llm.int8":
        return Format(8, None, True, "llm.int8")
    if scheme != "int":
        raise QliteError(f"--format {scheme}: unknown")
    if bits not in (4, 8):
        raise QliteError(f"--bits {bits}: qlite quantizes to 4 or 8 bits")
    if group_size is not None and group_size <= 0:
        raise QliteError(f"--group-size {group_size}: must be a positive number of weights")
    if bits == 4 and group_size is None:
        raise QliteError("--group-size: int4 needs a group size (for example 128)")
    return Format(bits, group_size, True if bits == 8 else symmetric)  # int8 is symmetric


# --- int4 packing ------------------------------------------------------------------------------

def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """codes uint8 [N, K] in 0..15 -> uint8 [N, ceil(K/2)]; an odd K gets a zero high nibble."""
    if codes.shape[-1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    pairs = codes.reshape(*codes.shape[:-1], -1, 2)  # (N, ceil(K/2), 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_int4(packed: torch.Tensor, in_features: int, high_first: bool = False) -> torch.Tensor:
    """uint8 [N, ceil(K/2)] -> codes uint8 [N, K] (high_first: bitsandbytes' nibble order)."""
    lo, hi = packed & 0xF, packed >> 4
    both = torch.stack([hi, lo] if high_first else [lo, hi], dim=-1)  # (N, ceil(K/2), 2)
    return both.reshape(*packed.shape[:-1], -1)[..., :in_features]


# --- dequantization (the reference every kernel is tested against) -----------------------------

def _per_column(groupwise: torch.Tensor, in_features: int) -> torch.Tensor:
    """[N, groups] -> [N, K], each group's value repeated over its columns."""
    return groupwise.repeat_interleave(in_features // groupwise.shape[-1], dim=-1)


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return qweight.float() * _per_column(scales.float(), qweight.shape[-1])


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, in_features: int) -> torch.Tensor:
    codes = unpack_int4(qweight, in_features).float()
    return (codes - _per_column(zeros.float(), in_features)) * _per_column(scales.float(), in_features)


def load_bitsandbytes():
    """Import bitsandbytes quietly: its CPU backend logs a warning when an optional hub kernel
    package is missing, which it is here (and it never needs to be)."""
    import logging
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    import bitsandbytes
    import bitsandbytes.functional
    return bitsandbytes


def nf4_codebook() -> torch.Tensor:
    """The 16 NF4 values (QLoRA, Dettmers et al. 2023), as bitsandbytes defines them."""
    return load_bitsandbytes().functional.get_4bit_type("nf4", device="cpu").float()


def dequantize_nf4(qweight: torch.Tensor, absmax: torch.Tensor, in_features: int) -> torch.Tensor:
    codes = unpack_int4(qweight, in_features, high_first=True).long()
    return nf4_codebook().to(qweight.device)[codes] * _per_column(absmax.float(), in_features)


def dequantize_llm_int8(qweight: torch.Tensor, scb: torch.Tensor) -> torch.Tensor:
    return qweight.float() * (scb.float() / 127)[:, None]


# --- which module gets which format --------------------------------------------------------------

def quantization_config(fmt: Format, lm_head_bits: int, skip: tuple[str, ...] = (), method: str = "rtn",
                        extra: dict | None = None) -> dict:
    return {"quant_method": QUANT_METHOD, "format_version": FORMAT_VERSION, "method": method,
            "scheme": fmt.scheme, "bits": fmt.bits, "group_size": fmt.group_size, "symmetric": fmt.symmetric,
            "modules": list(LINEAR_KINDS), "lm_head_bits": lm_head_bits, "skip": list(skip), **(extra or {})}


def parse_quantization_config(q: dict, source: str) -> dict:
    """Validate a config.json quantization_config; refuse what this version cannot read."""
    if not isinstance(q, dict) or q.get("quant_method") != QUANT_METHOD:
        method = q.get("quant_method") if isinstance(q, dict) else q
        raise QliteError(f"{source}: quantization method {method!r} is not one qlite reads")
    if q.get("format_version") != FORMAT_VERSION:
        raise QliteError(f"{source}: quantization format_version {q.get('format_version')!r} is unknown to this "
                         f"qlite (it reads version {FORMAT_VERSION}); upgrade qlite or re-quantize")
    try:
        if q.get("scheme", "int") not in SCHEMES:
            raise QliteError(f"{source}: quantization scheme {q.get('scheme')!r} is unknown to this qlite")
        validate_format(int(q["bits"]), q.get("group_size"), bool(q.get("symmetric", False)), q.get("scheme", "int"))
        if int(q.get("lm_head_bits", 16)) not in (4, 8, 16):
            raise QliteError(f"{source}: lm_head_bits must be 4, 8 or 16")
    except (KeyError, TypeError, ValueError) as e:
        raise QliteError(f"{source}: malformed quantization_config ({e})") from None
    return q


def module_format(q: dict, module_name: str) -> Format | None:
    """The format of a linear module (by its dotted name), or None if it stays 16-bit."""
    if any(s and s in module_name for s in q.get("skip", ())):
        return None
    main = validate_format(int(q["bits"]), q.get("group_size"), bool(q.get("symmetric")), q.get("scheme", "int"))
    if module_name == "lm_head":
        bits = int(q.get("lm_head_bits", 16))
        if bits == 16:
            return None
        if bits == 8:
            return Format(8, None, True)  # per channel: the fast int8 kernel
        return main if main.bits == 4 and main.scheme == "int" else Format(4, 128, False)
    kind = module_name.rsplit(".", 1)[-1]
    if re.fullmatch(r"model\.layers\.\d+\.(self_attn|mlp)\.\w+", module_name) and kind in q.get("modules", ()):
        return main
    return None


def describe_quantization(q: dict) -> str:
    main = module_format({**q, "skip": []}, "model.layers.0.self_attn.q_proj")
    head = module_format({**q, "skip": []}, "lm_head")
    text = f"{q.get('method', 'rtn')} {main.name if main else '16-bit'}, lm_head {head.name if head else '16-bit'}"
    if q.get("skip"):
        text += f", skipped: {', '.join(q['skip'])}"
    return text + f" (format v{q.get('format_version')})"
