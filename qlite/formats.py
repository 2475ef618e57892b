"""The registry of quantized formats: one class per format family, registered by its (scheme, bits)
key. A format object knows its stored tensors and their shapes, its bits per weight, how to quantize
a float weight (round to nearest on its grid) and how to dequantize; nothing else in qlite branches
on a format. Pure functions; the quantizer (quantize/) and the runtime share them.

Canonical layouts on disk (kernel-independent; a kernel may repack at load), G = group size:
  int8-gG / int8:   qweight int8 [N, K], scales fp16 [N, K/G] (int8: one per row)     w = q * s
  int4-gG[-sym]:    qweight uint8 [N, ceil(K/2)] (column 2j in the low nibble, 2j+1 in the high),
                    scales fp16 [N, K/G], zeros uint8 [N, K/G] (integer zero points)  w = (q - z) * s
  int4k-gG:         as int4-gG, but scales uint8 [N, K/G] are codes c under row_scales fp16 [N, 1]:
                    s = fp16(d * c) (llama.cpp's k-quant idea: the scales quantized too)
  int3k-gG, int2k-gG: b-bit codes q in 0..2^b-1, w = (q - z) * s; K a multiple of 128, G of 16, 32, 64, 128;
                    qweight uint8 [N, b*K/8], each 128 inputs of a row in 32 (int2) or 48 (int3) bytes: first
                    their low two bits, byte i holding inputs i, i+32, i+64, i+96 in bits 0-1, 2-3, 4-5, 6-7
                    (a shift and a mask give 32 consecutive inputs), then int3's high bits, byte i holding
                    inputs i + 16j in bit j; scales uint8 [N, K/G] each c << b | z: a scale code c in
                    1..2^(8-b)-1 and the integer zero point z; row_scales fp16 [N, 1] d; s = fp16(d * c)
  int4h-gG, int3h-gG: int4-gG's and int3k-gG's tensors for W R in place of W (Rotated below: R = D H on each
                    128 inputs, fixed signs D and the orthonormal Hadamard H); w = dequantized rows times R^T
The bitsandbytes peer formats keep bitsandbytes' own layout:
  nf4-bB:    qweight uint8 [N, K/2] (column 2j in the HIGH nibble), absmax fp32 [N, K/B]  w = NF4[q] * absmax
  llm.int8:  qweight int8 [N, K], scb fp32 [N] (row absmax)                               w = q * scb / 127
Every stored tensor is per output row, so formats concatenate along rows (fused projections).

A format is one class: besides its layout, it says how the CLI spells it (its scheme is `--format`'s
value), its default group size, whether calibration (GPTQ, act-rtn) and activation-aware grids apply,
its measured decode cost for `--target-bpw`, and its exact encoding as other engines' integer grids
(`to_affine` / `from_affine`, or a refusal). Nothing else in qlite branches on a format (an ast check
in tests/test_formats_one_class.py); kernels name the layouts they read.

Adding a format: a subclass with its key, `name`, `parse`, `stored_shapes`, `quantize_rows` and
`dequantize` (docs/internals.md); it then quantizes, loads, runs on the reference kernel and appears in
`qlite quantize --help`. A native kernel for it goes in kernels.py.
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from typing import ClassVar, Mapping

import torch

from .errors import QliteError

SCALE_BITS, ZERO_BITS = 16, 8
SCALE_CODE_MAX = 255  # int4k's scale codes: 1..255 (uint8)
FP16_SMALLEST = 2.0 ** -24  # the smallest positive float16: a scale must not round to zero
INT8_MAX = 127
INT8_OFFSET = 128  # int8 codes as unsigned ones for other engines: u = q + 128
CHUNK_ELEMENTS = 1 << 19  # weights quantized at a time: their float32 temporaries (2 MB each) stay in the caches
# (faster at 7B's width than 4096 rows at a time: BENCHMARKS.md), and a 150k-row lm_head never has more alive


def chunk_rows(in_features: int) -> int:
    """Rows of an [N, in_features] weight quantized at a time (every format quantizes rows independently)."""
    return max(1, CHUNK_ELEMENTS // in_features)

REGISTRY: dict[tuple[str, int], type["Format"]] = {}


@dataclass(frozen=True)
class Format:
    """A quantized format; subclasses register with `class X(Format, scheme=..., bits=...)`."""
    group_size: int | None = None  # weights per scale along the input; None: one per output row
    symmetric: bool = True

    scheme: ClassVar[str]  # also `qlite quantize --format`'s spelling of the family
    bits: ClassVar[int]
    aliases: ClassVar[tuple[str, ...]] = ()  # other --format spellings of the family
    peer: ClassVar[str | None] = None  # made by another library (its method name), not qlite's quantizer
    default_group_size: ClassVar[int | None] = None  # `qlite quantize` without --group-size
    calibrated: ClassVar[bool] = False  # GPTQ / act-rtn can make it (an integer grid)
    # --target-bpw: picoseconds per weight of a decode step, by group size (None: per row); a format without
    # an entry is no candidate. From whole fused steps of single-format demo checkpoints (`python -m
    # eval.benchmarks.kernel_bench --steps DIR`, 2 rounds, the faster; AMD EPYC Zen 4, AVX-512 VNNI, 2 threads): the
    # int8 model's step over all its weights, each other format by its step's difference from int8's.
    decode_ps: ClassVar[dict[int | None, float]] = {}

    def __init_subclass__(cls, scheme: str, bits: int | None = None, **kw):
        super().__init_subclass__(**kw)
        cls.scheme = scheme
        if bits is not None:  # a family; without bits, a base shared by families
            cls.bits = bits
            REGISTRY[(scheme, bits)] = cls

    # --- what each format defines ---
    @property
    def name(self) -> str:
        raise NotImplementedError

    @classmethod
    def parse(cls, name: str) -> "Format | None":
        """The format of this family with that name, or None."""
        raise NotImplementedError

    @classmethod
    def make(cls, group_size: int | None, symmetric: bool) -> "Format":
        """The format of this family for config fields (validated)."""
        return cls(group_size, symmetric)

    def stored_shapes(self, out_features: int, in_features: int) -> dict[str, tuple[torch.dtype, tuple]]:
        raise NotImplementedError

    def quantize_rows(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """Float weight rows [n, K] -> stored tensors (called on chunks of rows)."""
        raise NotImplementedError

    def dequantize(self, stored: Mapping[str, torch.Tensor], in_features: int) -> torch.Tensor:
        """The float32 weight [N, K] that the stored tensors stand for."""
        raise NotImplementedError

    # --- shared ---
    def groups(self, in_features: int) -> int:
        return 1 if self.group_size is None else in_features // self.group_size

    def nbytes(self, out_features: int, in_features: int) -> int:
        """Bytes of the stored tensors of one [N, K] weight."""
        return sum(torch.empty((), dtype=d).element_size() * math.prod(s)
                   for d, s in self.stored_shapes(out_features, in_features).values())

    def bits_per_weight(self, in_features: int) -> float:
        """Storage bits per weight, scales and zero points included (from the stored shapes)."""
        return 8 * self.nbytes(1, in_features) / in_features

    def quantize(self, w: torch.Tensor, **options) -> dict[str, torch.Tensor]:
        """A float weight [N, K] -> its stored tensors, chunk_rows(K) rows at a time (options: quantize_rows')."""
        rows = chunk_rows(w.shape[1])
        parts = [self.quantize_rows(w[i:i + rows], **options) for i in range(0, w.shape[0], rows)]
        return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}

    def fields(self) -> dict:
        """The quantization_config fields that name this format (format_version 1)."""
        return {"scheme": self.scheme, "bits": self.bits, "group_size": self.group_size, "symmetric": self.symmetric}

    def check(self, in_features: int, where: str) -> None:
        if self.group_size is not None and in_features % self.group_size:
            raise QliteError(f"group size {self.group_size} does not divide {where}'s input width {in_features}")

    def in_features(self, shapes: Mapping[str, tuple]) -> int:
        """The input width K of a weight from its stored tensors' shapes (by name)."""
        return shapes["qweight"][1]

    def check_stored(self, stored: Mapping[str, torch.Tensor]) -> str | None:
        """What is wrong with stored values that the dtypes and shapes allow but the format does not
        (None: nothing): checked at load, so no kernel or export sees them."""
        return None

    def input_signs(self) -> torch.Tensor | None:
        """A rotated format's signs (Rotated): its kernels turn the activations first; None: none."""
        return None

    def stored_basis(self, w: torch.Tensor) -> torch.Tensor:
        """The weight [N, K] in the basis the stored codes round (W; a rotated format's W R)."""
        return w

    def stored_hessian(self, hessian: torch.Tensor) -> torch.Tensor:
        """The inputs' Hessian [K, K] in that basis (H; a rotated format's R^T H R)."""
        return hessian

    @property
    def act_aware(self) -> bool:
        """Whether act-rtn / GPTQ choose its grids from calibration inputs (else min-max grids)."""
        return False

    @property
    def budget_ps(self) -> float | None:
        """Its decode cost per weight for --target-bpw (None: not a candidate)."""
        return type(self).decode_ps.get(self.group_size)

    # --- other engines' integer grids: w = (u - zu) * s, u unsigned `bits`-bit codes, fp16 scales ---
    @property
    def affine_symmetric(self) -> bool | None:
        """Whether its grid has a fixed zero point 2^(bits-1) (peers then store none); None: no exact
        encoding (exports refuse it)."""
        return None

    @property
    def exports(self) -> bool:
        return self.affine_symmetric is not None

    def to_affine(self, stored: Mapping[str, torch.Tensor], in_features: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes u uint8 [N, K], fp16 scales [N, groups], zero points zu uint8 [N, groups])."""
        raise QliteError(f"format {self.name}: no exact encoding in other engines' formats; only qlite's int4 "
                         f"and int8 formats export")

    def affine_zeros(self, read) -> torch.Tensor:
        """to_affine's zero points zu alone, from `read(suffix)` of the stored tensors it needs (an export
        chooses a block type or version by them without unpacking the codes)."""
        raise QliteError(f"format {self.name}: no exact encoding in other engines' formats")

    def from_affine(self, u: torch.Tensor, scales: torch.Tensor, zu: torch.Tensor, where: str
                    ) -> dict[str, torch.Tensor]:
        """Its stored tensors for codes u [N, K], scales and zero points zu [N, groups] (to_affine's inverse)."""
        raise QliteError(f"{where}: format {self.name} is not imported")

    @classmethod
    def for_peer(cls, bits: int, group_size: int | None, symmetric: bool, in_features: int, where: str
                 ) -> "Format | None":
        """The format of this family that stores a peer's (bits, group size or None per channel,
        symmetric) grid exactly, or None."""
        return None


def stored_problem(fmt: Format, stored: Mapping[str, torch.Tensor], input_order: torch.Tensor | None) -> str | None:
    """What is wrong with one module's stored values (the format's own check, and an input_order that
    is no permutation of the input columns), or None."""
    problem = fmt.check_stored(stored)
    if problem is None and input_order is not None and not torch.equal(
            torch.sort(input_order.long()).values, torch.arange(input_order.numel(), device=input_order.device)):
        problem = f"input_order is not a permutation of its {input_order.numel()} input columns"
    return problem


def format_named(name: str) -> Format:
    """The format with that name (int8, int8-g64, int4-g128, int4-g32-sym, nf4-b64, llm.int8)."""
    for cls in REGISTRY.values():
        fmt = cls.parse(name)
        if fmt is not None:
            if fmt.group_size is not None and fmt.group_size <= 0:
                raise QliteError(f"format {name!r}: group size {fmt.group_size} must be a positive number of weights")
            return fmt
    raise QliteError(f"format {name!r}: unknown (known: int8, int8-gG, int4-gG, int4-gG-sym, int4k-gG, int3k-gG, "
                     f"int2k-gG, int4h-gG, int3h-gG, nf4-bB, llm.int8)")


def format_for_fields(scheme: str, bits: int | None, group_size: int | None, symmetric: bool) -> Format:
    """The format a config's fields (or the quantize flags) name; bits None: the scheme's only family."""
    if bits is None:
        families = [cls for (s, _), cls in REGISTRY.items() if s == scheme]
        cls = families[0] if len(families) == 1 else None
    else:
        cls = REGISTRY.get((scheme, bits))
    if cls is None:
        if scheme == "int":
            raise QliteError(f"bits {bits}: the int scheme has 4 and 8 bits (intk has 2, 3 and 4)")
        known = sorted(b for s, b in REGISTRY if s == scheme)
        raise QliteError(f"bits {bits}: {scheme} has {', '.join(map(str, known))} bits" if known else f"scheme {scheme!r}: unknown")
    if group_size is not None and (not isinstance(group_size, int) or group_size <= 0):
        raise QliteError(f"group size {group_size}: must be a positive number of weights")
    return cls.make(group_size, symmetric)


def family(scheme: str, bits: int | None) -> type[Format]:
    """The registered class of `--format SCHEME` (an alias included) and `--bits`; None bits: the
    scheme's only family."""
    scheme = next((cls.scheme for cls in REGISTRY.values() if scheme in cls.aliases), scheme)
    families = {b: cls for (s, b), cls in REGISTRY.items() if s == scheme}
    if not families:
        raise QliteError(f"--format {scheme}: unknown (known: {', '.join(format_spellings())})")
    only = next(iter(families.values()))
    if len(families) == 1 and (bits is None or only.peer):  # a peer's format has its own width
        return only
    if bits not in families:
        raise QliteError(f"--bits {bits}: --format {scheme} has {', '.join(map(str, sorted(families)))} bits")
    return families[bits]


def format_spellings() -> list[str]:
    """`qlite quantize --format` values: every family's scheme and aliases."""
    return list(dict.fromkeys(s for cls in REGISTRY.values() for s in (cls.scheme, *cls.aliases)))


def bit_widths() -> list[str]:
    """`qlite quantize --bits` values."""
    return [str(b) for b in sorted({cls.bits for cls in REGISTRY.values()})]


def flag_format(scheme: str, bits: int, group_size: int | None, symmetric: bool) -> Format:
    """The decoder linears' format that `--format SCHEME --bits B [--group-size G] [--symmetric]` names."""
    cls = family(scheme, bits)
    return format_for_fields(cls.scheme, cls.bits, cls.default_group_size if group_size is None else group_size,
                             symmetric)


def table_format(bits: int, group_size: int | None, symmetric: bool, linear: Format, flag: str = "--lm-head-bits"
                 ) -> Format | None:
    """lm_head's format for --lm-head-bits, or the embeddings' for --embed-bits, beside decoder linears in
    `linear`: 16 none; 8 int8 per output row (the fast int8 kernels); 4 the linears' own 4-bit integer
    family (int4, or int4k with --format intk) with --group-size (128 if not given) and --symmetric."""
    if bits == 16:
        return None
    if bits not in (4, 8):
        raise QliteError(f"{flag} {bits}: choose 4, 8 or 16")
    cls = REGISTRY.get((linear.scheme, bits))
    cls = cls if cls is not None and cls.calibrated else REGISTRY[("int", bits)]
    return cls.make(None, True) if bits == 8 else cls.make(group_size or 128, symmetric)


def legacy_head_format(linear: Format, bits: int) -> Format | None:
    """lm_head in a config written before lm_head_format: at 4 bits the linears' own int4 format, else
    table_format's rule with group size 128."""
    if bits == 4 and isinstance(linear, Int4):
        return linear
    return table_format(bits, 128, False, format_for_fields("int", 8, None, True))


def budget_candidates(least_bits: int = 0) -> list[Format]:
    """The formats --target-bpw chooses among (those with a decode cost, of least_bits or more), fewest bits per
    weight first."""
    found = [cls.make(g, False) for cls in REGISTRY.values() if cls.bits >= least_bits for g in cls.decode_ps]
    return sorted(found, key=lambda f: f.bits_per_weight(4096))


def format_for_peer(bits: int, group_size: int | None, symmetric: bool, in_features: int, where: str) -> Format:
    """qlite's format for a peer's (bits, group size or None per channel, symmetric) integer grid."""
    for cls in REGISTRY.values():
        fmt = cls.for_peer(bits, group_size, symmetric, in_features, where)
        if fmt is not None:
            return fmt
    raise QliteError(f"{where}: {bits}-bit weights; qlite reads 4 and 8 bits")


# --- integer grids (round to nearest; GPTQ quantizes column by column on the same grid) -------------

FP16_LARGEST = 65504.0


def fp16_scale(scale: torch.Tensor) -> torch.Tensor:
    """Scales rounded to float16 before codes are computed, so stored (codes, scales) agree. A scale
    past float16's range (finite weights near 1e38, say) cannot be stored: an error, not infinity."""
    if scale.numel() and float(scale.max()) > FP16_LARGEST:
        raise QliteError(f"weights up to {float(scale.max()):.3g} times the code range: past the largest "
                         f"float16 scale ({FP16_LARGEST:g}); this format cannot store them")
    return scale.clamp(min=FP16_SMALLEST).half().float()


def round_to_grid(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Integer codes (float tensor) of w on the grid (q - zero) * scale, q in lo..hi (broadcasting)."""
    return (torch.round(w / scale) + zero).clamp(lo, hi)


def per_column(groupwise: torch.Tensor, in_features: int) -> torch.Tensor:
    """[N, groups] -> [N, K], each group's value repeated over its columns."""
    return groupwise.repeat_interleave(in_features // groupwise.shape[-1], dim=-1)


@dataclass(frozen=True)
class IntFormat(Format, scheme="int"):
    """qlite's integer formats: w = (q - z) * s per group, an fp16 scale s, codes q in lo..hi."""
    lo: ClassVar[int]
    hi: ClassVar[int]
    calibrated = True

    def search_scale(self, range_scale: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """The stored scale nearest a wanted one (act-rtn's search over shrunk min-max scales)."""
        return fp16_scale(range_scale)

    def row_scales(self, wg: torch.Tensor) -> torch.Tensor | None:
        """A format whose group scales are quantized too: each row's scale of scales [N, 1], from all the
        row's groups wg (N, groups, G); fixed before any group's grid (GPTQ: from the original weights)."""
        return None

    def grid(self, wg: torch.Tensor, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, zero) of weight groups wg (N, ..., G), scale already rounded as stored; rows: row_scales."""
        raise NotImplementedError

    def encode(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
               rows: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Integer codes [N, K] (float) and per-group scale/zero [N, groups] -> stored tensors."""
        raise NotImplementedError

    def quantize_rows(self, w, grid=None):
        """grid: a function (wg, rows) -> (scale, zero) in place of the format's min-max one (quantize/act_grid.py)."""
        N, K = w.shape
        wg = w.float().reshape(N, self.groups(K), -1)  # (N, groups, G)
        rows = self.row_scales(wg)
        scale, zero = (grid or self.grid)(wg, rows)  # (N, groups)
        q = round_to_grid(wg, scale[..., None], zero[..., None], self.lo, self.hi)
        return self.encode(q.reshape(N, K), scale, zero, rows)



@dataclass(frozen=True)
class Int8(IntFormat, scheme="int", bits=8):
    """Symmetric int8, q in -127..127, one scale per output row (int8) or per group (int8-gG)."""
    lo, hi = -INT8_MAX, INT8_MAX
    decode_ps = {None: 18.2, 32: 20.5}

    @property
    def name(self):
        return "int8" if self.group_size is None else f"int8-g{self.group_size}"

    @classmethod
    def parse(cls, name):
        m = re.fullmatch(r"int8(?:-g(\d+))?", name)
        return m and cls.make(int(m[1]) if m[1] else None, True)

    @classmethod
    def make(cls, group_size, symmetric):
        return cls(group_size, True)  # int8 is always symmetric

    def stored_shapes(self, out_features, in_features):
        return {"qweight": (torch.int8, (out_features, in_features)),
                "scales": (torch.float16, (out_features, self.groups(in_features)))}

    def grid(self, wg, rows=None):
        scale = fp16_scale(wg.abs().amax(-1) / INT8_MAX)
        return scale, torch.zeros_like(scale)

    def encode(self, codes, scale, zero, rows=None):
        return {"qweight": codes.to(torch.int8), "scales": scale.half()}

    def dequantize(self, stored, in_features):
        return stored["qweight"].float() * per_column(stored["scales"].float(), in_features)

    affine_symmetric = True  # u = q + 128, zu = 128

    def to_affine(self, stored, in_features):
        u = (stored["qweight"].to(torch.int16) + INT8_OFFSET).to(torch.uint8)
        return u, stored["scales"], self.affine_zeros(stored.__getitem__)

    def affine_zeros(self, read):
        return torch.full(read("scales").shape, INT8_OFFSET, dtype=torch.uint8)

    def from_affine(self, u, scales, zu, where):
        if (zu != INT8_OFFSET).any():
            raise QliteError(f"{where}: 8-bit zero points other than 128 (asymmetric int8); qlite's int8 is symmetric")
        return {"qweight": (u.to(torch.int16) - INT8_OFFSET).to(torch.int8), "scales": scales}

    @classmethod
    def for_peer(cls, bits, group_size, symmetric, in_features, where):
        if bits != 8:
            return None
        if not symmetric:
            raise QliteError(f"{where}: asymmetric int8; qlite's int8 is symmetric")
        return cls(None if group_size in (None, in_features) else group_size)


@dataclass(frozen=True)
class Int4(IntFormat, scheme="int", bits=4):
    """int4 codes 0..15, w = (q - z) * s per group. Asymmetric: s = (max - min) / 15 over a range that
    includes 0 (a constant group is exact too), integer zero point z; symmetric: s = absmax / 7.5
    (the whole of -8..7 where the sign allows), z = 8. Zero points are stored either way."""
    symmetric: bool = False
    lo, hi = 0, 15
    default_group_size = 128
    decode_ps = {128: 13.5}

    @property
    def name(self):
        return f"int4-g{self.group_size}" + ("-sym" if self.symmetric else "")

    @classmethod
    def parse(cls, name):
        m = re.fullmatch(r"int4-g(\d+)(-sym)?", name)
        return m and cls.make(int(m[1]), bool(m[2]))

    @classmethod
    def make(cls, group_size, symmetric):
        if group_size is None:
            raise QliteError("int4 needs a group size (for example 128)")
        return cls(group_size, bool(symmetric))

    def stored_shapes(self, out_features, in_features):
        g = self.groups(in_features)
        return {"qweight": (torch.uint8, (out_features, (in_features + 1) // 2)),
                "scales": (torch.float16, (out_features, g)), "zeros": (torch.uint8, (out_features, g))}

    def grid(self, wg, rows=None):
        if self.symmetric:
            scale = fp16_scale(wg.abs().amax(-1) / 7.5)
            return scale, torch.full_like(scale, 8)
        lo, range_scale = asymmetric_range(wg)
        scale = fp16_scale(range_scale)
        return scale, torch.round(-lo / scale).clamp(0, 15)

    def encode(self, codes, scale, zero, rows=None):
        return {"qweight": pack_int4(codes.to(torch.uint8)), "scales": scale.half(), "zeros": zero.to(torch.uint8)}

    def group_scales(self, stored: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Each group's scale, float32 [N, groups]."""
        return stored["scales"].float()

    def in_features(self, shapes):
        return shapes["scales"][1] * self.group_size  # qweight holds ceil(K/2) bytes; the groups say K exactly

    def check_stored(self, stored):
        top = int(stored["zeros"].max()) if stored["zeros"].numel() else 0
        return f"zero point {top} is past int4's codes 0..15" if top > self.hi else None

    def dequantize(self, stored, in_features):
        codes = unpack_int4(stored["qweight"], in_features).float()
        zeros, scales = per_column(stored["zeros"].float(), in_features), per_column(self.group_scales(stored), in_features)
        return (codes - zeros) * scales

    @property
    def act_aware(self):
        return not self.symmetric  # symmetric int4 keeps min-max grids

    @property
    def affine_symmetric(self):
        return self.symmetric

    def to_affine(self, stored, in_features):  # int4k's coded scales as the fp16 numbers they stand for (exactly)
        return unpack_int4(stored["qweight"], in_features), self.group_scales(stored).half(), self.affine_zeros(stored.__getitem__)

    def affine_zeros(self, read):
        return read("zeros")

    def from_affine(self, u, scales, zu, where):
        return {"qweight": pack_int4(u), "scales": scales, "zeros": zu}

    @classmethod
    def for_peer(cls, bits, group_size, symmetric, in_features, where):
        return cls(group_size or in_features, bool(symmetric)) if bits == 4 else None


def asymmetric_range(wg: torch.Tensor, top: int = 15) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, (hi - lo) / top) of groups wg (..., G), over a range that includes 0 (a constant group is exact
    too); top: the largest code."""
    lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
    return lo, (hi - lo) / top


class CodedScales:
    """The grids of the formats whose group scales are codes c in 1..code_max() under one fp16 scale d per row
    (int4k, int3k, int2k): d is the row's largest min-max scale over code_max(), rounded up to fp16 (by 2^-10
    first) so that no group's code passes code_max(); each group's c is rounded up, so its range still fits."""

    @classmethod
    def code_max(cls) -> int:
        return SCALE_CODE_MAX

    def row_scales(self, wg):
        return fp16_scale(asymmetric_range(wg, self.hi)[1].amax(-1, keepdim=True) / self.code_max() * (1 + 2.0 ** -10))

    def search_scale(self, range_scale, rows):
        return coded_scale(rows, torch.ceil(range_scale / rows).clamp(1, self.code_max()))

    def grid(self, wg, rows=None):
        lo, range_scale = asymmetric_range(wg, self.hi)
        d = rows.reshape(rows.shape[0], *[1] * (range_scale.dim() - 1))  # (N, 1...) against (N, ...)
        scale = self.search_scale(range_scale, d)
        return scale, torch.round(-lo / scale).clamp(0, self.hi)


@dataclass(frozen=True)
class Int4K(CodedScales, Int4, scheme="intk", bits=4):
    """int4 whose group scales are quantized too (llama.cpp's k-quant idea): scale s = fp16(d * c), c an
    8-bit code in 1..SCALE_CODE_MAX, d one fp16 scale per row; zero points and codes as asymmetric int4's.
    d is the row's largest min-max scale over SCALE_CODE_MAX, and each c is rounded up, so every group's
    range still fits; the weights are then rounded onto the grid the coded scale makes. 8-bit codes lose
    nothing measurable against fp16 scales (SQNR within 0.03 dB on the demo model), so int4k-g32 keeps
    int4-g32's error at 4.5 bits per weight instead of 4.75 (int4k-g64: int4-g64's at 4.25)."""
    default_group_size = 32
    decode_ps = {64: 16.2, 32: 18.5}

    @property
    def name(self):
        return f"int4k-g{self.group_size}"

    @classmethod
    def parse(cls, name):
        m = re.fullmatch(r"int4k-g(\d+)", name)
        return m and cls.make(int(m[1]), False)

    @classmethod
    def make(cls, group_size, symmetric):
        if symmetric:
            raise QliteError("int4k is asymmetric only")
        return super().make(group_size, False)

    def stored_shapes(self, out_features, in_features):
        shapes = super().stored_shapes(out_features, in_features)
        shapes["scales"] = (torch.uint8, shapes["scales"][1])
        return {**shapes, "row_scales": (torch.float16, (out_features, 1))}

    def encode(self, codes, scale, zero, rows=None):
        stored = super().encode(codes, scale, zero)
        # scale = fp16(d c) is within 2^-11 of d c, so the code is the nearest integer to scale / d
        stored["scales"] = torch.round(scale / rows).clamp(1, SCALE_CODE_MAX).to(torch.uint8)
        return {**stored, "row_scales": rows.half()}

    def group_scales(self, stored):
        return coded_scale(stored["row_scales"].float(), stored["scales"].float())

    def from_affine(self, u, scales, zu, where):
        raise QliteError(f"{where}: format {self.name} is not imported (a peer's int4 is int4-gG)")

    @classmethod
    def for_peer(cls, bits, group_size, symmetric, in_features, where):
        return None  # a peer's int4 grid is plain int4's


def coded_scale(d: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """int4k's group scale: fp16(d * code), as float32 (the kernels compute it the same way)."""
    return (d * code).half().float()


LOW_BIT_BLOCK = 128  # int3k's and int2k's codes are laid out 128 inputs at a time
LOW_BIT_GROUPS = (16, 32, 64, 128)


class GroupedBy128:
    """The formats named int{bits}{letter}-gG (int3k, int2k; int4h, int3h): asymmetric, groups of 16 to 128, input
    widths a multiple of 128 (their codes', or their rotation's, blocks)."""
    letter: ClassVar[str]

    @property
    def name(self):
        return f"int{self.bits}{self.letter}-g{self.group_size}"

    @classmethod
    def parse(cls, name):
        m = re.fullmatch(rf"int{cls.bits}{cls.letter}-g(\d+)", name)
        return m and cls.make(int(m[1]), False)

    @classmethod
    def make(cls, group_size, symmetric):
        if symmetric:
            raise QliteError(f"int{cls.bits}{cls.letter} is asymmetric only")
        if group_size not in LOW_BIT_GROUPS:
            raise QliteError(f"int{cls.bits}{cls.letter}'s group size is 16, 32, 64 or 128, not {group_size}")
        return cls(group_size, False)

    def check(self, in_features, where):
        if in_features % LOW_BIT_BLOCK:
            raise QliteError(f"int{self.bits}{self.letter} takes input widths that are multiples of {LOW_BIT_BLOCK}; "
                             f"{where}'s is {in_features}")


@dataclass(frozen=True)
class IntLowK(GroupedBy128, CodedScales, IntFormat, scheme="intk"):
    """Below 4 bits (int3k-gG, int2k-gG): asymmetric b-bit codes with int4k's coded scales, each group's
    scale code and zero point sharing one byte (c << b | z), so a group costs 8 bits besides its codes:
    int3k-g32 is 3.25 bits per weight, int2k-g16 2.5 (llama.cpp's Q3_K 3.44, Q2_K 2.63)."""
    symmetric: bool = False
    lo = 0
    default_group_size = 32
    # the integer-activation products in lanes (vnni-lowbit), timed as the others on a Zen 4 machine (AVX-512): the
    # medians of 18 interleaved rounds, their differences from int4-g128's, scaled by the table's int4-g128 step
    # over that machine's (BENCHMARKS.md "int3k and int2k in lanes on AVX-512")
    decode_ps = {16: 14.3, 32: 14.0}

    letter = "k"

    @classmethod
    def code_max(cls) -> int:  # the scale code's bits: those the zero point leaves of its byte
        return (1 << (8 - cls.bits)) - 1

    def stored_shapes(self, out_features, in_features):
        return {"qweight": (torch.uint8, (out_features, self.bits * in_features // 8)),
                "scales": (torch.uint8, (out_features, self.groups(in_features))),
                "row_scales": (torch.float16, (out_features, 1))}

    def in_features(self, shapes):
        return shapes["scales"][1] * self.group_size

    def encode(self, codes, scale, zero, rows=None):
        code = torch.round(scale / rows).clamp(1, self.code_max()).to(torch.uint8)  # as int4k's encode
        return {"qweight": pack_low_bits(codes.to(torch.uint8), self.bits),
                "scales": (code << self.bits) | zero.to(torch.uint8), "row_scales": rows.half()}

    def group_scales(self, stored):
        return coded_scale(stored["row_scales"].float(), (stored["scales"] >> self.bits).float())

    def dequantize(self, stored, in_features):
        codes = unpack_low_bits(stored["qweight"], self.bits, in_features).float()
        zeros = per_column((stored["scales"] & self.hi).float(), in_features)
        return (codes - zeros) * per_column(self.group_scales(stored), in_features)

    def check_stored(self, stored):
        return "a scale code 0" if stored["scales"].numel() and bool(((stored["scales"] >> self.bits) == 0).any()) else None

    @property
    def act_aware(self):
        return True


@dataclass(frozen=True)
class Int3K(IntLowK, scheme="intk", bits=3):
    hi = 7


@dataclass(frozen=True)
class Int2K(IntLowK, scheme="intk", bits=2):
    hi = 3
    decode_ps = {16: 11.7, 32: 9.9}


# --- under a Hadamard rotation ------------------------------------------------------------------------

TURN_BLOCK = LOW_BIT_BLOCK  # inputs per Hadamard transform (GroupedBy128 checks the widths)
TURN_SIGNS = 0xdd7a81ed5fad86b437afac294b3c58da  # bit i set: input i of every block flips its sign


@functools.lru_cache(maxsize=None)
def turn_signs() -> torch.Tensor:
    """The signs D of the rotation, float32 [TURN_BLOCK] of +-1 (the same for every block and tensor). Made once
    (an embedding lookup turns rows back at every step), outside inference mode so any caller may use it; read-only."""
    with torch.inference_mode(False):
        return torch.tensor([-1.0 if TURN_SIGNS >> i & 1 else 1.0 for i in range(TURN_BLOCK)])


@functools.lru_cache(maxsize=None)
def hadamard(n: int) -> torch.Tensor:
    """The orthonormal Sylvester Hadamard matrix [n, n] (n a power of 2): symmetric, its own inverse. Made once,
    as turn_signs; read-only."""
    with torch.inference_mode(False):
        h = torch.ones(1, 1)
        while h.shape[0] < n:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
        return h / n ** 0.5


def turn(x: torch.Tensor) -> torch.Tensor:
    """Rows x [..., K] (K a multiple of TURN_BLOCK) times R = D H on each block of TURN_BLOCK inputs, in float32:
    for a weight, W R (what a rotated format rounds); for activations, R^T x as rows (what its kernel reads:
    y = (W R)(R^T x) = W x). D H is (x * D) @ H, and R^T x is H (D x), the same (H is symmetric)."""
    blocks = x.float().reshape(*x.shape[:-1], -1, TURN_BLOCK)  # (..., K / TURN_BLOCK, TURN_BLOCK)
    return ((blocks * turn_signs().to(x.device)) @ hadamard(TURN_BLOCK).to(x.device)).reshape(x.shape)


def unturn(w: torch.Tensor) -> torch.Tensor:
    """turn's inverse on rows: W R R^T = (W R) H D."""
    blocks = w.float().reshape(*w.shape[:-1], -1, TURN_BLOCK) @ hadamard(TURN_BLOCK).to(w.device)
    return (blocks * turn_signs().to(w.device)).reshape(w.shape)


class Rotated(GroupedBy128):
    """A format that rounds W R in place of W (int4h-gG, int3h-gG): R = D H on each 128 inputs, random signs D
    (TURN_SIGNS) and the orthonormal Hadamard transform H (QuaRot, QuIP#). R spreads a row's outliers over its
    128 inputs, so fewer of them set a group's range: at group size 128 a third to a half less KLD than the same
    grid unrotated (BENCHMARKS.md, issue 56). The stored codes are its base format's for W R; `dequantize` gives
    back W ~ Q(W R) R^T, and a kernel reads the codes as they are and rotates the activations first (R^T x,
    one fast transform per product). Calibration rounds W R against the rotated inputs' Hessian R^T H R.
    No other engine has it: exports refuse it."""
    default_group_size = 128
    letter = "h"

    def input_signs(self):
        return turn_signs()

    def stored_basis(self, w):
        return turn(w)

    def stored_hessian(self, hessian):
        return turn(turn(hessian).t()).t()  # R^T H R: turn's rows, then its columns

    def quantize_rows(self, w, grid=None):
        return super().quantize_rows(turn(w), grid)

    def dequantize(self, stored, in_features):
        return unturn(super().dequantize(stored, in_features))

    affine_symmetric = None  # no exact encoding elsewhere: exports refuse it
    to_affine, affine_zeros, from_affine = Format.to_affine, Format.affine_zeros, Format.from_affine

    @classmethod
    def for_peer(cls, bits, group_size, symmetric, in_features, where):
        return None


@dataclass(frozen=True)
class Int4H(Rotated, Int4, scheme="inth", bits=4):
    """int4-gG's codes, fp16 scales and zero points for W R (Rotated): int4h-g128 is 4.19 bits per weight."""
    # No --target-bpw candidate (no decode cost here): in the budget's mixes, which rank formats by their round-to-
    # nearest error, the rotated formats made q3 worse and q4 no better (BENCHMARKS.md "Rotated formats int4h and
    # int3h"); their decode cost measured 14.0 ps a weight (int4h-g128) and 12.2 (int3h-g128), as IntLowK's.
    decode_ps = {}


@dataclass(frozen=True)
class Int3H(Rotated, Int3K, scheme="inth", bits=3):
    """int3k-gG's codes and coded scales for W R (Rotated): int3h-g128 is 3.07 bits per weight."""
    decode_ps = {}  # as Int4H's


# --- bitsandbytes' formats, quantized by bitsandbytes itself ------------------------------------------

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


@dataclass(frozen=True)
class NF4(Format, scheme="nf4", bits=4):
    """NF4 (QLoRA): blocks of group_size weights (64 by default), float32 absmax per block."""
    peer = "bnb"

    @property
    def name(self):
        return f"nf4-b{self.group_size}"

    @classmethod
    def parse(cls, name):
        m = re.fullmatch(r"nf4(?:-b(\d+))?", name)
        return m and cls.make(int(m[1]) if m[1] else None, True)

    @classmethod
    def make(cls, group_size, symmetric):
        return cls(group_size or 64, True)

    def stored_shapes(self, out_features, in_features):
        return {"qweight": (torch.uint8, (out_features, in_features // 2)),
                "absmax": (torch.float32, (out_features, self.groups(in_features)))}

    def quantize_rows(self, w):
        N, K = w.shape
        packed, state = load_bitsandbytes().functional.quantize_4bit(w.float().contiguous(), blocksize=self.group_size,
                                                                     quant_type="nf4")
        return {"qweight": packed.reshape(N, K // 2), "absmax": state.absmax.reshape(N, self.groups(K))}

    def dequantize(self, stored, in_features):
        codes = unpack_int4(stored["qweight"], in_features, high_first=True).long()
        return nf4_codebook().to(codes.device)[codes] * per_column(stored["absmax"].float(), in_features)


@dataclass(frozen=True)
class LLMInt8(Format, scheme="llm.int8", bits=8):
    """LLM.int8 (Dettmers et al. 2022): int8 per row with a float32 row absmax; outlier activation
    columns are handled by its kernel at inference."""
    peer, aliases = "bnb", ("bnb-int8",)

    @property
    def name(self):
        return "llm.int8"

    @classmethod
    def parse(cls, name):
        return cls() if name == "llm.int8" else None

    @classmethod
    def make(cls, group_size, symmetric):
        return cls(None, True)

    def stored_shapes(self, out_features, in_features):
        return {"qweight": (torch.int8, (out_features, in_features)), "scb": (torch.float32, (out_features,))}

    def quantize_rows(self, w):
        codes, row_absmax, _ = load_bitsandbytes().functional.int8_vectorwise_quant(w.half().contiguous())
        return {"qweight": codes, "scb": row_absmax.float()}

    def dequantize(self, stored, in_features):
        return stored["qweight"].float() * (stored["scb"].float() / 127)[:, None]


# --- int4 packing ------------------------------------------------------------------------------

def pack_low_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """b-bit codes uint8 [N, K] (b 2 or 3, K a multiple of 128) -> uint8 [N, b*K/8], 128 inputs at a time:
    32 bytes of their low two bits (byte i: inputs i + 32t in bits 2t, 2t+1), then int3's 16 bytes of high
    bits (byte i: input i + 16j in bit j)."""
    N, K = codes.shape
    by_32 = codes.reshape(N, K // LOW_BIT_BLOCK, 4, 32)  # (N, blocks, t, i): input 32t + i of a block
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=codes.device)[:, None]  # (4, 1)
    low = ((by_32 & 3) << shifts).sum(2, dtype=torch.uint8)  # (N, blocks, 32); disjoint bits: the sum is an OR
    if bits == 3:
        by_16 = codes.reshape(N, K // LOW_BIT_BLOCK, 8, 16)  # (N, blocks, j, i): input 16j + i
        high = (((by_16 >> 2) & 1) << torch.arange(8, dtype=torch.uint8, device=codes.device)[:, None]).sum(2, dtype=torch.uint8)
        low = torch.cat([low, high], dim=-1)  # (N, blocks, 48)
    return low.reshape(N, -1)


def unpack_low_bits(packed: torch.Tensor, bits: int, in_features: int) -> torch.Tensor:
    """pack_low_bits' inverse: codes uint8 [N, K]."""
    N, blocks = packed.shape[0], in_features // LOW_BIT_BLOCK
    per_block = packed.reshape(N, blocks, -1)  # (N, blocks, 32 or 48)
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=packed.device)[:, None]  # (4, 1)
    codes = (per_block[:, :, None, :32] >> shifts) & 3  # (N, blocks, t, i)
    if bits == 3:
        bit = torch.arange(8, dtype=torch.uint8, device=packed.device)[:, None]  # (8, 1)
        high = (per_block[:, :, None, 32:] >> bit) & 1  # (N, blocks, j, i): input 16j + i
        codes = codes | (high.reshape(N, blocks, 4, 32) << 2)
    return codes.reshape(N, in_features)


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
    return both.reshape(*packed.shape[:-1], 2 * packed.shape[-1])[..., :in_features]
