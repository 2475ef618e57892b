"""QuantConfig: which module of a Qwen2 checkpoint is stored in which format, parsed and validated
once from config.json's `quantization_config` (format_version 1) or from the quantize flags.

The per-module rules, all of them:
- the decoder's linears named in `modules` (all seven kinds by default) take the main format;
- lm_head takes `lm_head` (its own format, or None for 16-bit); from the flags: --lm-head-bits 8 is
  int8 per output row, 4 is int4 with --group-size (128 if not given) and --symmetric, 16 keeps it;
- the token embeddings take `embeddings` (None: 16-bit), from --embed-bits by the same rule (int8 per
  row by default, 16-bit for bitsandbytes' formats); a lookup dequantizes only the rows it reads. A
  tied checkpoint whose embeddings and lm_head have the same format (both 16-bit, or both int8, ...)
  stores the table once, as model.embed_tokens, and the head uses it; with different formats the head
  is stored as its own lm_head;
- a module whose dotted name contains a `skip` substring stays 16-bit;
- everything else (norms, biases) stays 16-bit.
A mixed checkpoint (`qlite quantize --target-bpw`) also holds `module_formats`: decoder linears by
checkpoint name -> their own format name (null: 16-bit), which take precedence over `linear`. Such
checkpoints are format_version 3 (with or without input_order), so an older qlite refuses them.
With `input_order` (imported act-order GPTQ / compressed-tensors checkpoints), every quantized linear
also stores `input_order` int32 [K]: its codes are stored in that column order, groups contiguous in
it, and the layer reads x[..., input_order]. Such checkpoints are format_version 2, so a qlite that
predates the field refuses them instead of running them wrong.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property

from .errors import QliteError
from .fields import field_of
from .formats import Format, flag_format, format_for_fields, format_named, legacy_head_format, table_format

FORMAT_VERSION = 1
FORMAT_VERSION_INPUT_ORDER = 2  # written only when input_order is set
FORMAT_VERSION_MIXED = 3  # written only when module_formats is set
VERSIONS = (FORMAT_VERSION, FORMAT_VERSION_INPUT_ORDER, FORMAT_VERSION_MIXED)
QUANT_METHOD = "qlite"
LINEAR_KINDS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
METHODS = ("rtn", "act-rtn", "gptq", "bnb")
# act-rtn / GPTQ: the share of H's mean diagonal added to its diagonal (docs/quantize.md, --method gptq, for how it was chosen)
DAMP = 0.3
EMBEDDINGS = "model.embed_tokens"
# a decoder layer's module (a dense MLP's, an expert's, the shared expert's); its kind
DECODER_MODULE = re.compile(r"model\.layers\.\d+\.(?:self_attn|mlp|mlp\.experts\.\d+|mlp\.shared_expert)\.(\w+)")
_KNOWN_KEYS = {"quant_method", "format_version", "method", "scheme", "bits", "group_size", "symmetric", "modules",
               "lm_head_bits", "lm_head_format", "embed_format", "skip", "input_order", "module_formats"}


@dataclass(frozen=True)
class QuantConfig:
    linear: Format  # the decoder linears' format
    lm_head: Format | None  # None: 16-bit
    method: str = "rtn"
    modules: tuple[str, ...] = LINEAR_KINDS
    skip: tuple[str, ...] = ()
    params: dict = field(default_factory=dict)  # the method's settings, recorded (GPTQ: act_order, damp, ...)
    input_order: bool = False  # quantized linears store a column order (see the module docstring)
    embeddings: Format | None = None  # None: 16-bit
    module_formats: tuple[tuple[str, Format | None], ...] = ()  # decoder linears in their own format (None: 16-bit)

    @classmethod
    def from_options(cls, bits: int = 4, group_size: int | None = None, symmetric: bool = False, scheme: str = "int",
                     lm_head_bits: int | None = None, skip=(), method: str = "rtn", params: dict | None = None,
                     embed_bits: int | None = None) -> "QuantConfig":
        """From the quantize flags. bitsandbytes formats are made by bitsandbytes (method "bnb") and
        keep lm_head and the embeddings 16-bit by default, as transformers does for them; qlite's make
        both int8 per row (a tied model then stores one int8 table)."""
        linear = flag_format(scheme, bits, group_size, symmetric)
        table_bits = 16 if linear.peer else 8  # a peer's (bitsandbytes') model keeps them 16-bit, as transformers does
        group = linear.group_size if group_size is None and linear.calibrated else group_size  # the family's default

        def table(bits, flag):
            return table_format(table_bits if bits is None else bits, group, symmetric, linear, flag)
        return cls(linear, table(lm_head_bits, "--lm-head-bits"), linear.peer or method, LINEAR_KINDS, tuple(skip),
                   dict(params or {}), embeddings=table(embed_bits, "--embed-bits"))

    @classmethod
    def from_dict(cls, q: dict, source: str) -> "QuantConfig":
        """Parse config.json's quantization_config; refuse what this version cannot read."""
        if not isinstance(q, dict) or q.get("quant_method") != QUANT_METHOD:
            method = q.get("quant_method") if isinstance(q, dict) else q
            hint = "; convert it once with `qlite import DIR --out DST`" if method in ("gptq", "compressed-tensors") else ""
            raise QliteError(f"{source}: quantization method {method!r} is not one qlite reads{hint}")
        version = q.get("format_version")
        if version not in VERSIONS:
            raise QliteError(f"{source}: quantization format_version {version!r} is unknown to this qlite (it reads "
                             f"versions {', '.join(map(str, VERSIONS))}); upgrade qlite or re-quantize")
        where = f"{source}: quantization_config"
        order, mixed = field_of(q, "input_order", bool, where, False), bool(q.get("module_formats"))
        if mixed != (version == FORMAT_VERSION_MIXED) or (order != (version == FORMAT_VERSION_INPUT_ORDER)
                                                            and version != FORMAT_VERSION_MIXED):
            raise QliteError(f"{source}: format_version {version} does not match the fields it holds "
                             f"(input_order: {FORMAT_VERSION_INPUT_ORDER} or {FORMAT_VERSION_MIXED}, "
                             f"module_formats: {FORMAT_VERSION_MIXED})")
        try:
            linear = format_for_fields(field_of(q, "scheme", str, where, "int"), field_of(q, "bits", int, where),
                                       field_of(q, "group_size", int, where, None),
                                       field_of(q, "symmetric", bool, where, False))
            if "lm_head_format" in q:
                head = None if q["lm_head_format"] is None else format_named(q["lm_head_format"])
            else:  # written before lm_head_format: lm_head 4-bit took the main int4 format, else int4-g128
                bits = field_of(q, "lm_head_bits", int, where, 16)
                head = legacy_head_format(linear, bits)
            embeddings = None if q.get("embed_format") is None else format_named(q["embed_format"])
            mixed = q.get("module_formats") or {}
            if not isinstance(mixed, dict) or not all(isinstance(k, str) and DECODER_MODULE.fullmatch(k)
                                                      for k in mixed):
                raise QliteError("module_formats must map decoder linears (model.layers.N.mlp.down_proj, ...) "
                                 "to format names")
            module_formats = tuple((k, None if v is None else format_named(v)) for k, v in mixed.items())
            modules, skip = tuple(q.get("modules", LINEAR_KINDS)), tuple(q.get("skip", ()))
        except QliteError as e:
            raise QliteError(f"{source}: {e}") from None
        except (KeyError, TypeError, ValueError) as e:
            raise QliteError(f"{source}: malformed quantization_config ({e})") from None
        if not set(modules) <= set(LINEAR_KINDS) or not all(isinstance(s, str) for s in skip):
            raise QliteError(f"{source}: quantization_config modules must be among {', '.join(LINEAR_KINDS)}")
        return cls(linear, head, str(q.get("method", "rtn")), modules, skip,
                   {k: v for k, v in q.items() if k not in _KNOWN_KEYS}, order,
                   embeddings, module_formats)

    def to_dict(self) -> dict:
        version = (FORMAT_VERSION_MIXED if self.module_formats else
                   FORMAT_VERSION_INPUT_ORDER if self.input_order else FORMAT_VERSION)
        return {"quant_method": QUANT_METHOD, "format_version": version, "method": self.method,
                **self.linear.fields(), "modules": list(self.modules),
                "lm_head_bits": self.lm_head.bits if self.lm_head else 16,
                "lm_head_format": self.lm_head.name if self.lm_head else None,
                **({"embed_format": self.embeddings.name} if self.embeddings else {}), "skip": list(self.skip),
                **({"input_order": True} if self.input_order else {}),
                **({"module_formats": {k: f.name if f else None for k, f in self.module_formats}}
                   if self.module_formats else {}), **self.params}

    def format_for(self, module_name: str) -> Format | None:
        """The format of a linear module (by its checkpoint name), or None if it stays 16-bit."""
        if any(s and s in module_name for s in self.skip):
            return None
        if module_name == "lm_head":
            return self.lm_head
        if module_name == EMBEDDINGS:
            return self.embeddings
        m = DECODER_MODULE.fullmatch(module_name)
        if m and module_name in self._own_formats:
            return self._own_formats[module_name]
        return self.linear if m and m[1] in self.modules else None

    @cached_property
    def _own_formats(self) -> dict[str, Format | None]:
        return dict(self.module_formats)

    @property
    def suffix(self) -> str:
        """What the default output dir adds to the source's name: int4-g128, gptq-int4-g128-act, ..."""
        if "preset" in self.params:
            return str(self.params["preset"])
        if "target_bpw" in self.params:
            return f"bpw{self.params['target_bpw']:g}"
        if "target_kld" in self.params:
            return f"kld{self.params['target_kld']:g}"
        name = self.linear.name if self.method in ("rtn", "bnb") else f"{self.method}-{self.linear.name}"
        return name + ("-act" if self.params.get("act_order") else "")

    def shares_table(self, tied: bool) -> bool:
        """Whether a tied model's head uses the embedding table as stored (the same format)."""
        return tied and self.embeddings == self.lm_head

    def describe(self) -> str:
        text = f"{self.method} {self.linear.name}"
        if self.module_formats:
            names = sorted({f.name if f else "16-bit" for _, f in self.module_formats})
            text = f"{self.method} mixed: {', '.join(names)} ({len(self.module_formats)} linears by name)"
        text += f", lm_head {self.lm_head.name if self.lm_head else '16-bit'}"
        if self.embeddings:
            text += f", embeddings {self.embeddings.name}"
        if self.skip:
            text += f", skipped: {', '.join(self.skip)}"
        if self.input_order:
            text += ", act-order (input_order)"
        return text
