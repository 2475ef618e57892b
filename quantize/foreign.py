"""Other engines' quantized layouts mapped exactly onto qlite's, both ways (pure functions).

qlite (formats.py), per linear [N, K], G weights per group along K:
  int4-gG: codes q 0..15 [N, K] two per byte (column 2j in the low nibble), fp16 scales and uint8
           zero points z [N, K/G]; w = (q - z) * s. int4k-gG exports as int4-gG: its scales are fp16 numbers.
  int8:    codes q -127..127 int8 [N, K], fp16 scales [N, K/G] (or [N, 1]); w = q * s.
Both are written here as unsigned b-bit codes u (int4: u = q; int8: u = q + 128) with zero points
zu (int4: z; int8: 128), w = (u - zu) * s: the form both peers below store.

compressed-tensors `pack-quantized` (llm-compressor, vLLM), b in {4, 8}:
  weight_packed int32 [N, ceil(K*b/32)]: code k of a row at bit b*k of the row's little-endian bit
  stream, stored as q_signed + 2^(b-1) = u; weight_scale [N, K/G] (strategy group) or [N, 1]
  (channel); weight_zero_point (asymmetric only) int32 [ceil(N*b/32), K/G], packed the same way
  along N; weight_shape int64 [2] = (N, K); optional weight_g_idx [K] (actorder group).
  So an int4 weight_packed holds exactly qlite's qweight bytes.
GPTQ (AutoGPTQ, GPTQModel, transformers, vLLM), b in {4, 8}:
  qweight int32 [K*b/32, N] packed along K; qzeros int32 [K/G, N*b/32] packed along N; scales fp16
  [K/G, N]; g_idx int32 [K], the group of each input column (act-order: not k // G).
  checkpoint_format gptq (v1) stores zu - 1 in qzeros (so zu = 0 cannot be written), gptq_v2 zu.
A g_idx that is a permutation of groups becomes qlite's input_order (qconfig.py): the columns sorted
by group, so groups are contiguous again, and the layer gathers x's columns the same way.

Packing is done through bytes viewed as int32, so it assumes a little-endian host (x86, ARM).
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from qlite.errors import QliteError
from qlite.formats import Format, pack_int4, stored_problem, unpack_int4

assert sys.byteorder == "little", "quantize.foreign packs through little-endian byte views"


# --- b-bit codes <-> int32 words -----------------------------------------------------------------

def pack_words(u: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes uint8 [..., M] -> int32 [..., ceil(M*bits/32)], code i at bit bits*i."""
    packed = pack_int4(u) if bits == 4 else u  # (..., ceil(M*bits/8)) bytes
    packed = F.pad(packed, (0, -packed.shape[-1] % 4))  # whole words
    return packed.contiguous().reshape(-1).view(torch.int32).reshape(*packed.shape[:-1], -1)


def unpack_words(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """int32 [..., W] -> unsigned codes uint8 [..., count] (pack_words' inverse)."""
    packed = words.contiguous().reshape(-1).view(torch.uint8).reshape(*words.shape[:-1], -1)  # (..., 4W) bytes
    return unpack_int4(packed, count) if bits == 4 else packed[..., :count]


# qlite's stored tensors <-> (u, scales, zu): each format's to_affine / from_affine (formats.py);
# a peer's grid -> qlite's format: formats.format_for_peer.

def fp16_scales(scales: torch.Tensor, where: str) -> torch.Tensor:
    """A peer's scales as float16, refused unless that is exact (bf16/fp32 scales usually are)."""
    half = scales.half()
    if not torch.equal(half.to(scales.dtype), scales):
        raise QliteError(f"{where}: scales are not exactly representable in float16")
    return half


# --- act-order ---------------------------------------------------------------------------------

def order_from_g_idx(g_idx: torch.Tensor, group_size: int, where: str) -> torch.Tensor | None:
    """qlite's input_order for a g_idx (None: the plain k // G), refused unless every group holds
    exactly group_size columns."""
    K = g_idx.numel()
    plain = torch.arange(K) // group_size
    g = g_idx.long().flatten()
    if torch.equal(g, plain):
        return None
    groups = K // group_size
    if g.min() < 0 or g.max() >= groups or not torch.all(torch.bincount(g, minlength=groups) == group_size):
        raise QliteError(f"{where}: g_idx is not a permutation of {groups} groups of {group_size} columns")
    return torch.argsort(g, stable=True).to(torch.int32)


def g_idx_from_order(order: torch.Tensor | None, in_features: int, group_size: int) -> torch.Tensor:
    """The g_idx of a layer whose stored column j is input column order[j]."""
    plain = (torch.arange(in_features) // group_size).to(torch.int32)
    if order is None:
        return plain
    g_idx = torch.empty_like(plain)
    g_idx[order.long()] = plain
    return g_idx


def original_columns(u: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """Codes [N, K] in stored column order -> input column order."""
    if order is None:
        return u
    out = torch.empty_like(u)
    out[:, order.long()] = u
    return out


def group_size_of(fmt: Format, in_features: int) -> int:
    return fmt.group_size or in_features


# --- compressed-tensors pack-quantized -------------------------------------------------------------

def ct_shapes(fmt: Format, out_features: int, in_features: int) -> dict[str, tuple[torch.dtype, tuple]]:
    b, groups = fmt.bits, fmt.groups(in_features)
    shapes = {"weight_packed": (torch.int32, (out_features, -(-in_features * b // 32))),
              "weight_scale": (torch.float16, (out_features, groups)),
              "weight_shape": (torch.int64, (2,))}
    if not fmt.affine_symmetric:
        shapes["weight_zero_point"] = (torch.int32, (-(-out_features * b // 32), groups))
    return shapes


def to_compressed_tensors(fmt: Format, stored: dict[str, torch.Tensor], in_features: int, where: str
                          ) -> dict[str, torch.Tensor]:
    u, scales, zu = fmt.to_affine(stored, in_features)
    out = {"weight_packed": pack_words(u, fmt.bits), "weight_scale": scales,
           "weight_shape": torch.tensor([u.shape[0], in_features], dtype=torch.int64)}
    if fmt.affine_symmetric:
        if (zu != 2 ** (fmt.bits - 1)).any():
            raise QliteError(f"{where}: a symmetric format with zero points other than {2 ** (fmt.bits - 1)}")
    else:
        out["weight_zero_point"] = pack_words(zu.T, fmt.bits).T.contiguous()  # packed along N
    return out


def from_compressed_tensors(fmt: Format, t: dict[str, torch.Tensor], out_features: int, in_features: int,
                            where: str) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """(qlite's stored tensors in stored column order, input_order or None)."""
    b, groups = fmt.bits, fmt.groups(in_features)
    expect = {name: shape for name, (_, shape) in ct_shapes(fmt, out_features, in_features).items()}
    expect["weight_g_idx"] = (in_features,)
    for name, tensor in t.items():
        if name not in expect or tuple(tensor.shape) != expect[name]:
            raise QliteError(f"{where}.{name}: shape {tuple(tensor.shape)}, expected "
                             f"{expect.get(name, 'no such tensor')} for {fmt.name} {out_features}x{in_features}")
    if "weight_shape" in t and t["weight_shape"].tolist() != [out_features, in_features]:
        raise QliteError(f"{where}.weight_shape is {t['weight_shape'].tolist()}, the config implies "
                         f"{[out_features, in_features]}")
    u = unpack_words(t["weight_packed"], b, in_features)
    if "weight_zero_point" in t:
        zu = unpack_words(t["weight_zero_point"].T, b, out_features).T.contiguous()  # (N, groups)
    else:
        zu = torch.full((out_features, groups), 2 ** (b - 1), dtype=torch.uint8)
    order = None
    if "weight_g_idx" in t:
        order = order_from_g_idx(t["weight_g_idx"], group_size_of(fmt, in_features), f"{where}.weight_g_idx")
    u = u if order is None else u[:, order.long()]
    scales = fp16_scales(t["weight_scale"].reshape(out_features, groups), f"{where}.weight_scale")
    return fmt.from_affine(u, scales, zu, where), order


# --- GPTQ --------------------------------------------------------------------------------------------

def gptq_shapes(fmt: Format, out_features: int, in_features: int) -> dict[str, tuple[torch.dtype, tuple]]:
    b, groups = fmt.bits, fmt.groups(in_features)
    return {"qweight": (torch.int32, (in_features * b // 32, out_features)),
            "qzeros": (torch.int32, (groups, out_features * b // 32)),
            "scales": (torch.float16, (groups, out_features)),
            "g_idx": (torch.int32, (in_features,))}


def to_gptq(fmt: Format, stored: dict[str, torch.Tensor], in_features: int, order: torch.Tensor | None, v1: bool,
            where: str) -> dict[str, torch.Tensor]:
    u, scales, zu = fmt.to_affine(stored, in_features)
    u = original_columns(u, order)
    if v1:
        if (zu == 0).any():
            raise QliteError(f"{where}: {int((zu == 0).sum())} groups have zero point 0, which GPTQ v1 cannot store "
                             f"(it stores zero - 1); export with --gptq-format v2")
        zu = zu - 1
    return {"qweight": pack_words(u, fmt.bits).T.contiguous(),  # packed along K, then (K*b/32, N)
            "qzeros": pack_words(zu.T.contiguous(), fmt.bits),  # (groups, N*b/32), packed along N
            "scales": scales.T.contiguous(),
            "g_idx": g_idx_from_order(order, in_features, group_size_of(fmt, in_features))}


def from_gptq(fmt: Format, t: dict[str, torch.Tensor], out_features: int, in_features: int, v1: bool, where: str
              ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """(qlite's stored tensors in stored column order, input_order or None)."""
    b, groups = fmt.bits, fmt.groups(in_features)
    if (in_features * b) % 32 or (out_features * b) % 32:
        raise QliteError(f"{where}: {out_features}x{in_features} does not pack into 32-bit words at {b} bits")
    expect = {name: shape for name, (_, shape) in gptq_shapes(fmt, out_features, in_features).items()}
    for name, tensor in t.items():
        if name not in expect or tuple(tensor.shape) != expect[name]:
            raise QliteError(f"{where}.{name}: shape {tuple(tensor.shape)}, expected "
                             f"{expect.get(name, 'no such tensor')} for {b}-bit group size "
                             f"{group_size_of(fmt, in_features)} at {out_features}x{in_features}")
    u = unpack_words(t["qweight"].T, b, in_features)  # (N, K), input column order
    zu = unpack_words(t["qzeros"], b, out_features).T.to(torch.int16)  # (N, groups)
    if v1:
        zu = zu + 1
    if zu.max() > 2 ** b - 1:
        raise QliteError(f"{where}.qzeros: {int((zu > 2 ** b - 1).sum())} groups have zero point {2 ** b} (GPTQ v1 "
                         f"stored {2 ** b - 1}); qlite's zero points are 0..{2 ** b - 1}")
    order = None
    if "g_idx" in t:
        order = order_from_g_idx(t["g_idx"], group_size_of(fmt, in_features), f"{where}.g_idx")
    u = u if order is None else u[:, order.long()]
    scales = fp16_scales(t["scales"].T.reshape(out_features, groups), f"{where}.scales")
    return fmt.from_affine(u.contiguous(), scales.contiguous(), zu.to(torch.uint8).contiguous(), where), order


# --- GGUF blocks (llama.cpp) -----------------------------------------------------------------------
# Blocks of 32 weights along K, each block's fields little-endian, back to back:
#   Q8_0: d fp16, qs int8[32]                  w = qs * d                      (qlite int8: exact)
#   Q4_0: d fp16, qs uint8[16]                 w = (u - 8) * d                 (symmetric int4: exact)
#   Q4_1: d fp16, m fp16, qs uint8[16]         w = u * d + m                   (int4: m = -z * d in fp16)
#   qs of Q4_x: byte j holds u[j] (low nibble) and u[j + 16] (high nibble).
# A qlite group of G = 32k weights is k blocks with the same d.

GGUF_BLOCK = 32
GGUF_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


GGUF_TYPES = {(8, True): "Q8_0", (4, True): "Q4_0", (4, False): "Q4_1"}  # (bits, every zero point 2^(bits-1))


def gguf_type(bits: int, zu: torch.Tensor, where: str) -> str:
    """The GGUF block type of a layer's grid (bits, zero points zu): Q4_0 when every int4 zero point is 8."""
    kind = GGUF_TYPES.get((bits, bool((zu == 2 ** (bits - 1)).all())))
    if kind is None:
        raise QliteError(f"{where}: {bits}-bit codes with zero points have no GGUF block type")
    return kind


def _fp16_bytes(x: torch.Tensor) -> torch.Tensor:
    """fp16 [N, nb] -> uint8 [N, nb, 2] (little-endian)."""
    return x.half().contiguous().view(torch.uint8).reshape(*x.shape, 2)


def to_gguf_blocks(fmt: Format, stored: dict[str, torch.Tensor], in_features: int, where: str, kind: str | None = None
                   ) -> tuple[str, torch.Tensor]:
    """(GGUF type name, uint8 [N, K/32 * block bytes]) for a qlite int4/int8 layer; kind "Q8_0" for an int4
    one: its codes less their zero points (-15..15) as Q8_0's int8 under the same scale, exactly."""
    group = fmt.group_size or in_features
    if in_features % GGUF_BLOCK or (fmt.group_size is not None and group % GGUF_BLOCK):
        raise QliteError(f"{where}: group size {group} at input width {in_features} is not whole 32-weight GGUF "
                         f"blocks; quantize with --group-size 32, 64 or 128 to export GGUF")
    u, scales, zu = fmt.to_affine(stored, in_features)
    N, nb = u.shape[0], in_features // GGUF_BLOCK
    natural = gguf_type(fmt.bits, zu, where)
    kind = kind or natural
    d = scales.repeat_interleave(group // GGUF_BLOCK if fmt.group_size else nb, dim=1)  # (N, nb)
    if kind == "Q8_0":
        z = zu.repeat_interleave(group // GGUF_BLOCK if fmt.group_size else nb, dim=1)  # (N, nb): 128 for int8
        qs = (u.reshape(N, nb, GGUF_BLOCK).to(torch.int16) - z[..., None]).to(torch.int8).view(torch.uint8)  # signed
        fields = [_fp16_bytes(d), qs]
    else:
        ub = u.reshape(N, nb, GGUF_BLOCK)  # (N, nb, 32)
        qs = ub[..., :16] | (ub[..., 16:] << 4)  # (N, nb, 16)
        fields = [_fp16_bytes(d), qs]
        if kind == "Q4_1":
            z = zu.repeat_interleave(group // GGUF_BLOCK, dim=1).float()  # (N, nb)
            fields.insert(1, _fp16_bytes(-z * d.float()))
    return kind, torch.cat(fields, dim=-1).reshape(N, nb * GGUF_BLOCK_BYTES[kind])


def read_module(src, module: str, fmt: Format, qcfg
                ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """A qlite module's stored tensors and input_order (None when absent or the identity), their
    values checked (formats.stored_problem): nothing past the format's codes reaches another engine."""
    stored = {name: src.read(f"{module}.{name}") for name in fmt.stored_shapes(1, 1)}
    order = src.read(f"{module}.input_order") if qcfg is not None and qcfg.input_order else None
    problem = stored_problem(fmt, stored, order)
    if problem is not None:
        raise QliteError(f"{src.path}: {module}: {problem}")
    if order is not None and torch.equal(order.long(), torch.arange(order.numel())):
        order = None
    return stored, order


def affine_zeros(src, module: str, fmt: Format) -> torch.Tensor:
    """A stored module's zero points as other engines store them (Format.affine_zeros), read alone."""
    return fmt.affine_zeros(lambda suffix: src.read(f"{module}.{suffix}"))


def stored_in_features(src, module: str, fmt: Format) -> int:
    """A stored module's input width, from its tensors' shapes in the checkpoint (Format.in_features)."""
    return fmt.in_features({name: src.tensors[f"{module}.{name}"].shape for name in fmt.stored_shapes(1, 1)})
