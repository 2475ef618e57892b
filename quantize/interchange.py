"""Checkpoints that travel: a qlite checkpoint exported as compressed-tensors `pack-quantized` or
GPTQ (for transformers, vLLM, GPTQModel) or as a GGUF file (llama.cpp), and compressed-tensors /
GPTQ checkpoints imported into qlite's format once, exactly (`qlite import`). The tensor maps are
in foreign.py, GGUF blocks in gguf_export.py; this module plans and streams the files.

What maps exactly: int4 codes, scales and zero points both ways (GPTQ v1 cannot hold a zero point of
0: v2 is written for those); int8 per row or per group; act-order g_idx as qlite's input_order.
What is dequantized to float16 on export, and said so in the output's config.json (`qlite_export`):
a quantized lm_head in GPTQ (transformers' GPTQ loader ignores `lm_head: true` and runs a random head;
GPTQ also holds one format, and qlite's head is int8 by default).
What is refused: bitsandbytes formats, act-order checkpoints to compressed-tensors (its packed
compressor ignores g_idx), layer-specific 16-bit layers to GPTQ (it names them per block only).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator

import torch

from qlite.checkpoint import DTYPE_NAMES, FLOAT_STORAGE, CheckpointDir
from qlite.config import ModelConfig
from qlite.fields import field_of
from qlite.files import read_checkpoint_json
from qlite.errors import QliteError
from qlite.formats import Format, format_for_peer
from qlite.loader import check_loads
from qlite.outputs import check_output
from qlite.qconfig import DECODER_MODULE, EMBEDDINGS, LINEAR_KINDS, QuantConfig
from qlite.safetensors_io import TensorSpec, made_in_order, write_checkpoint_dir

from . import foreign
from .convert import expected_tensors, loading_order

EXPORT_TARGETS = ("compressed-tensors", "gptq", "gguf")
CT_SPEC_VERSION = "0.20.1"  # the compressed-tensors release whose pack-quantized layout this writes
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def linear_modules(shapes16: dict[str, tuple]) -> dict[str, tuple[int, int]]:
    """Every linear module of a 16-bit checkpoint's names -> (out_features, in_features)."""
    return {name.removesuffix(".weight"): shape for name, shape in shapes16.items()
            if name.endswith(".weight") and len(shape) == 2 and "embed_tokens" not in name}


def kind(module: str) -> str:
    m = DECODER_MODULE.fullmatch(module)
    return m[1] if m else module


@dataclass
class Job:
    """One output step: a tensor copied, or a module's tensors made by `make`."""
    specs: list[TensorSpec]
    make: Callable[[], dict[str, torch.Tensor]]  # output name -> tensor, in specs' order


@dataclass
class Output:
    jobs: list[Job] = field(default_factory=list)

    def copy(self, src: CheckpointDir, name: str, out_name: str | None = None) -> None:
        info = src.tensors[name]
        self.jobs.append(Job([TensorSpec(out_name or name, info.torch_dtype, info.shape)],
                             lambda: {out_name or name: src.read(name)}))

    def specs(self) -> list[TensorSpec]:
        return [s for job in self.jobs for s in job.specs]

    def tensors(self, specs: list[TensorSpec], progress: bool, desc: str) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors of `specs` (this output's, in any order), each job made when first due."""
        from tqdm import tqdm
        made_by = {s.name: job for job in self.jobs for s in job.specs}
        with tqdm(total=len(self.jobs), desc=desc, unit="tensor", disable=not progress, leave=False) as bar:
            yield from made_in_order(specs, made_by, lambda job: job.make(), bar.update)


def write_dir(src: CheckpointDir, out: Path, output: Output, config: dict, force: bool, progress: bool,
              desc: str, skip_files=(), specs: list[TensorSpec] | None = None, finish=None) -> None:
    """specs: the order to write the output's tensors in (default: its jobs' order); finish(tmp): run
    on the complete dir before it is moved into place."""
    specs = output.specs() if specs is None else specs
    write_checkpoint_dir(out, specs, output.tensors(specs, progress, desc), config, inputs=(src.path,), force=force,
                         side_files=[f for f in src.side_files() if f.name not in skip_files], finish=finish)


# --- export ----------------------------------------------------------------------------------------

def quantized_source(src: CheckpointDir) -> tuple[ModelConfig, QuantConfig, dict[str, tuple[int, int]]]:
    cfg = src.config
    if cfg.quantization is None:
        raise QliteError(f"{src.path}: a 16-bit checkpoint; quantize it first (qlite quantize), or export --to gguf")
    modules = [name.removesuffix(".qweight") for name in src.tensors
               if name.endswith(".qweight") and name != f"{EMBEDDINGS}.qweight"]  # the linears
    layer = {}
    for module in modules:
        fmt = cfg.quantization.format_for(module)
        if fmt is None or not fmt.exports:
            raise QliteError(f"{src.path}: {module} is {fmt.name if fmt else '16-bit'}; only qlite's int4 and int8 "
                             f"formats export (bitsandbytes formats stay bitsandbytes')")
        layer[module] = (src.tensors[f"{module}.scales"].shape[0], foreign.stored_in_features(src, module, fmt))
    return cfg, cfg.quantization, layer


def export_checkpoint(src: str | Path, to: str, out: str | Path, force: bool = False, gptq_format: str = "auto",
                      progress: bool = True) -> list[str]:
    """Write `src` (a qlite checkpoint dir) for another engine; returns notes on what did not map
    exactly (empty when everything did)."""
    if to not in EXPORT_TARGETS:
        raise QliteError(f"--to {to}: choose {', '.join(EXPORT_TARGETS)}")
    src_dir, out = CheckpointDir(src), Path(out).expanduser()
    if to == "gguf":  # a file: checked there
        from .gguf_export import export_gguf
        return export_gguf(src_dir, out, force, progress)
    check_output(out, force, inputs=(src_dir.path,))
    cfg, qcfg, layers = quantized_source(src_dir)
    if to == "compressed-tensors":
        return export_compressed_tensors(src_dir, out, cfg, qcfg, layers, force, progress)
    if gptq_format not in ("auto", "v1", "v2"):
        raise QliteError(f"--gptq-format {gptq_format}: choose auto, v1 or v2")
    return export_gptq(src_dir, out, cfg, qcfg, layers, gptq_format, force, progress)


def export_plan(src: CheckpointDir, layers: dict, module_job: Callable[[str], Job]) -> Output:
    """Every tensor of src in order: a quantized module's tensors made by `module_job`, quantized
    embeddings as a float16 table (neither target stores them quantized), the rest (and the quantized
    modules' biases) copied."""
    output = Output()
    embeddings = src.config.quantization.embeddings
    for name in src.tensors:
        module, _, suffix = name.rpartition(".")
        if module == EMBEDDINGS and embeddings is not None:
            if suffix == "qweight":
                output.jobs.append(float16_job(src, module, embeddings, src.config.hidden_size))
        elif module not in layers or suffix == "bias":
            output.copy(src, name)
        elif suffix == "qweight":
            output.jobs.append(module_job(module))
    return output


def float16_job(src: CheckpointDir, module: str, fmt: Format, in_features: int) -> Job:
    """A quantized module written as its dequantized float16 weight."""
    n = src.tensors[f"{module}.qweight"].shape[0]
    return Job([TensorSpec(f"{module}.weight", torch.float16, (n, in_features))], lambda: {
        f"{module}.weight": fmt.dequantize(foreign.read_module(src, module, fmt, src.config.quantization)[0], in_features).half()})


def embedding_notes(qcfg: QuantConfig, target: str) -> list[str]:
    if qcfg.embeddings is None:
        return []
    return [f"embeddings ({qcfg.embeddings.name}) written as float16: {target} stores no quantized embeddings"]


def _base_config(src: CheckpointDir, layers: dict) -> dict:
    config = {k: v for k, v in src.config_dict.items() if k != "quantization_config"}
    if "lm_head" in layers:
        config["tie_word_embeddings"] = False  # the head is its own tensor
    return config


def ct_weights_args(fmt: Format) -> dict:
    return {"num_bits": fmt.bits, "type": "int", "symmetric": fmt.affine_symmetric,
            "strategy": "channel" if fmt.group_size is None else "group", "group_size": fmt.group_size,
            "dynamic": False, "actorder": None, "block_structure": None, "observer": "minmax", "observer_kwargs": {}}


def export_compressed_tensors(src, out, cfg, qcfg, layers, force, progress) -> list[str]:
    if qcfg.input_order:
        raise QliteError(f"{src.path}: an act-order checkpoint (input_order); compressed-tensors' packed format "
                         f"does not apply g_idx when it decompresses: export --to gptq")
    def module_job(module: str) -> Job:
        fmt, (n, k) = qcfg.format_for(module), layers[module]
        specs = [TensorSpec(f"{module}.{s}", dt, shape) for s, (dt, shape) in foreign.ct_shapes(fmt, n, k).items()]
        return Job(specs, lambda: {f"{module}.{s}": t for s, t in foreign.to_compressed_tensors(
            fmt, foreign.read_module(src, module, fmt, qcfg)[0], k, module).items()})

    output = export_plan(src, layers, module_job)
    groups, ignore = {}, sorted(m for m in linear_modules(expected_tensors(_unquantized(cfg)))
                                if m not in layers)
    decoder = sorted({kind(m) for m in layers if m != "lm_head"})
    by_format = {}  # a mixed checkpoint (--target-bpw): one group per format, its modules by name
    for m in layers:
        if m != "lm_head":
            by_format.setdefault(qcfg.format_for(m), []).append(m)
    blocks = r"(self_attn|mlp|mlp\.experts\.\d+|mlp\.shared_expert)"  # a layer's, an expert's, the shared expert's
    targets = ({qcfg.linear: [rf"re:model\.layers\.\d+\.{blocks}\.({'|'.join(decoder)})$"]}
               if not qcfg.module_formats else by_format)
    for fmt, names in targets.items():
        groups[f"group_{len(groups)}"] = {"targets": names, "weights": ct_weights_args(fmt), "input_activations": None,
                                          "output_activations": None, "format": "pack-quantized"}
    if "lm_head" in layers:
        groups[f"group_{len(groups)}"] = {"targets": ["lm_head"], "weights": ct_weights_args(qcfg.lm_head),
                             "input_activations": None, "output_activations": None, "format": "pack-quantized"}
    config = _base_config(src, layers)
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": groups, "ignore": ignore, "kv_cache_scheme": None, "version": CT_SPEC_VERSION}
    write_dir(src, out, output, config, force, progress, "export")
    return embedding_notes(qcfg, "compressed-tensors")


def export_gptq(src, out, cfg, qcfg, layers, gptq_format, force, progress) -> list[str]:
    fmt = qcfg.linear
    if qcfg.module_formats:
        raise QliteError(f"{src.path}: a mix of formats (--target-bpw); a GPTQ config holds one: export --to "
                         f"compressed-tensors or gguf")
    if qcfg.skip:
        raise QliteError(f"{src.path}: 16-bit layers by name ({', '.join(qcfg.skip)}); GPTQ names them per block only: "
                         f"export --to compressed-tensors")
    decoder = [m for m in layers if m != "lm_head"]
    zero_free = all(not (foreign.affine_zeros(src, m, fmt) == 0).any() for m in decoder)
    if gptq_format == "v1" and not zero_free:
        raise QliteError(f"--gptq-format v1: {src.path} has groups with zero point 0, which GPTQ v1 cannot store "
                         f"(it stores zero - 1); use --gptq-format v2 (or auto)")
    v1 = gptq_format == "v1" or (gptq_format == "auto" and zero_free)
    notes = embedding_notes(qcfg, "GPTQ")
    if "lm_head" in layers:  # transformers' GPTQ loader ignores `lm_head: true` and would run a random head
        notes.append(f"lm_head ({qcfg.lm_head.name}) written as float16: transformers' GPTQ loader does not read a "
                     f"quantized lm_head")

    def module_job(module: str) -> Job:
        n, k = layers[module]
        if module == "lm_head":
            return float16_job(src, module, qcfg.lm_head, k)
        specs = [TensorSpec(f"{module}.{s}", dt, shape) for s, (dt, shape) in foreign.gptq_shapes(fmt, n, k).items()]
        return Job(specs, lambda: _gptq_tensors(src, module, fmt, qcfg, k, v1))

    output = export_plan(src, layers, module_job)
    config = _base_config(src, layers)
    config["quantization_config"] = {
        "quant_method": "gptq", "bits": fmt.bits, "group_size": -1 if fmt.group_size is None else fmt.group_size,
        "desc_act": qcfg.input_order, "sym": fmt.affine_symmetric, "static_groups": False,
        "true_sequential": True, "lm_head": False, "damp_percent": qcfg.params.get("damp", 0.01),
        "checkpoint_format": "gptq" if v1 else "gptq_v2", "pack_dtype": "int32",
        "modules_in_block_to_quantize": [[_block_name(k) for k in LINEAR_KINDS if k in qcfg.modules]]}
    if notes:
        config["qlite_export"] = {"notes": notes}
    write_dir(src, out, output, config, force, progress, "export")
    if not v1:
        notes.append("written as GPTQ v2 (checkpoint_format gptq_v2): some groups have zero point 0, which v1 "
                     "cannot store")
    return notes


def _gptq_tensors(src: CheckpointDir, module: str, fmt: Format, qcfg: QuantConfig, in_features: int, v1: bool
                  ) -> dict[str, torch.Tensor]:
    stored, order = foreign.read_module(src, module, fmt, qcfg)
    return {f"{module}.{s}": t for s, t in foreign.to_gptq(fmt, stored, in_features, order, v1, module).items()}


def _block_name(linear_kind: str) -> str:
    return f"{'mlp' if linear_kind in ('gate_proj', 'up_proj', 'down_proj') else 'self_attn'}.{linear_kind}"


def _unquantized(cfg: ModelConfig) -> ModelConfig:
    return replace(cfg, quantization=None)


# --- import ----------------------------------------------------------------------------------------

class ForeignSource:
    """A GPTQ or compressed-tensors checkpoint: which modules are quantized, in what format, and
    their tensors in qlite's layout."""
    method: str
    suffixes: tuple[str, ...]  # tensor name suffixes of a quantized module

    def __init__(self, src: CheckpointDir, q: dict, where: str):
        self.src, self.q, self.where = src, q, where

    def quantized(self, module: str) -> bool:
        return f"{module}.{self.suffixes[0]}" in self.src.tensors

    def module_format(self, module: str, in_features: int) -> Format:
        raise NotImplementedError

    def read(self, module: str, fmt: Format, shape: tuple[int, int]
             ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        raise NotImplementedError

    def shapes(self, fmt: Format, out_features: int, in_features: int) -> dict[str, tuple[torch.dtype, tuple]]:
        raise NotImplementedError

    optional: tuple[str, ...] = ()

    def check(self, module: str, fmt: Format, shape: tuple[int, int]) -> None:
        """Every tensor of a quantized module present with its dtype and shape (headers only)."""
        expect = self.shapes(fmt, *shape)
        for suffix in self.suffixes:
            name = f"{module}.{suffix}"
            info = self.src.tensors.get(name)
            if info is None:
                if suffix in expect and suffix not in self.optional:
                    raise QliteError(f"{self.src.path}: missing tensor {name}")
                continue
            dtype, want = expect.get(suffix, (None, None))
            packed = dtype == torch.int32 and "g_idx" not in suffix  # codes in int32 words; g_idx any integer
            if want is None or info.shape != tuple(want) or (packed and info.torch_dtype != dtype):
                raise QliteError(f"{info.file}: tensor {name} is {info.dtype} {info.shape}, expected "
                                 f"{'none' if want is None else f'{DTYPE_NAMES[dtype]} {tuple(want)}'} for "
                                 f"{fmt.name} at {shape[0]}x{shape[1]}")

    def tensors_of(self, module: str) -> dict[str, torch.Tensor]:
        return {s: self.src.read(f"{module}.{s}") for s in self.suffixes if f"{module}.{s}" in self.src.tensors}


class GptqSource(ForeignSource):
    method = "gptq"
    suffixes = ("qweight", "qzeros", "scales", "g_idx")
    optional = ("g_idx",)
    shapes = staticmethod(foreign.gptq_shapes)

    def __init__(self, src, q, where):
        super().__init__(src, q, where)
        try:
            self.bits, group = field_of(q, "bits", int, where), field_of(q, "group_size", int, where, -1)
            self.sym = field_of(q, "sym", bool, where, True)
        except (KeyError, TypeError, ValueError) as e:
            raise QliteError(f"{where}: malformed GPTQ quantization_config ({e})") from None
        format_for_peer(self.bits, None, self.sym, 1, where)  # a width or grid qlite has no format for: refused now
        if group == 0 or group < -1:
            raise QliteError(f"{where}: group_size {group}: must be -1 or positive")
        self.group = None if group == -1 else group
        fmt = q.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise QliteError(f"{where}: checkpoint_format {fmt!r}; qlite reads gptq (v1) and gptq_v2")
        self.v1 = fmt == "gptq"

    def module_format(self, module, in_features):
        if self.group is not None and in_features % self.group:
            raise QliteError(f"{self.where}: group_size {self.group} does not divide {module}'s input width "
                             f"{in_features}")
        return format_for_peer(self.bits, self.group, self.sym, in_features, self.where)

    def read(self, module, fmt, shape):
        return foreign.from_gptq(fmt, self.tensors_of(module), *shape, self.v1, f"{self.src.path}: {module}")


TARGET_SECONDS = 1.0  # a `re:` target may take this long to match one module name


def _matches(targets, module: str, where: str) -> bool:
    """Whether a compressed-tensors target list names module: "Linear", the name, or "re:PATTERN".
    Patterns come from the checkpoint: matched with a time bound (the `regex` package's timeout), so
    one that backtracks without end is an error naming it, not a hang."""
    import regex

    for t in targets:
        if not isinstance(t, str):
            raise QliteError(f"{where}: target {t!r} is not a string")
        if t == "Linear" or t == module:
            return True
        if t.startswith("re:"):
            try:
                if regex.match(t[3:], module, timeout=TARGET_SECONDS):
                    return True
            except TimeoutError:
                raise QliteError(f"{where}: target {t[:80]!r} took longer than {TARGET_SECONDS:g} s to match "
                                 f"{module}; simplify the pattern") from None
            except regex.error as e:
                raise QliteError(f"{where}: target {t[:80]!r} is not a regular expression ({e})") from None
    return False


class CompressedTensorsSource(ForeignSource):
    method = "compressed-tensors"
    suffixes = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")
    optional = ("weight_shape", "weight_g_idx")

    @staticmethod
    def shapes(fmt, out_features, in_features):
        return {**foreign.ct_shapes(fmt, out_features, in_features), "weight_g_idx": (torch.int32, (in_features,))}

    def __init__(self, src, q, where):
        super().__init__(src, q, where)
        groups = q.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise QliteError(f"{where}: no config_groups")
        self.groups = []
        for name, g in groups.items():
            if not isinstance(g, dict) or not isinstance(g.get("targets"), list) or not isinstance(g.get("weights"), dict):
                raise QliteError(f"{where}: config_groups.{name}: needs targets and weights")
            if g.get("input_activations") or g.get("output_activations"):
                raise QliteError(f"{where}: config_groups.{name} quantizes activations; qlite runs weight-only formats")
            fmt = g.get("format") or q.get("format")
            if fmt != "pack-quantized":
                raise QliteError(f"{where}: config_groups.{name}: format {fmt!r}; qlite reads pack-quantized")
            w = g["weights"]
            if w.get("type", "int") != "int" or w.get("strategy") not in ("group", "channel"):
                raise QliteError(f"{where}: config_groups.{name}: {w.get('type')} weights by {w.get('strategy')}; "
                                 f"qlite reads int weights by group or channel")
            self.groups.append((name, g["targets"], w))
        self.ignore = q.get("ignore") or []
        if not isinstance(self.ignore, list):
            raise QliteError(f"{where}: ignore must be a list of module names or re: patterns")

    def module_format(self, module, in_features):
        hits = [(name, w) for name, targets, w in self.groups
                if _matches(targets, module, f"{self.where}: config_groups.{name}.targets")]
        if not hits or _matches(self.ignore, module, f"{self.where}: ignore"):
            raise QliteError(f"{self.where}: {module} holds packed weights but no config group names it")
        name, w = hits[-1]
        try:
            bits = field_of(w, "num_bits", int, "weights")
            group = field_of(w, "group_size", int, "weights") if w["strategy"] == "group" else None
            if group is not None and (group <= 0 or in_features % group):
                raise QliteError(f"group_size {group} does not divide {module}'s input width {in_features}")
            return format_for_peer(bits, group, field_of(w, "symmetric", bool, "weights", True), in_features,
                                        module)
        except QliteError as e:
            raise QliteError(f"{self.where}: config_groups.{name}: {e}") from None
        except (KeyError, TypeError, ValueError) as e:
            raise QliteError(f"{self.where}: config_groups.{name}: malformed weights ({e})") from None

    def read(self, module, fmt, shape):
        return foreign.from_compressed_tensors(fmt, self.tensors_of(module), *shape, f"{self.src.path}: {module}")


SOURCES = {cls.method: cls for cls in (GptqSource, CompressedTensorsSource)}


def foreign_quantization(src: CheckpointDir) -> tuple[dict, str]:
    """The quantization_config of config.json (or a GPTQ quantize_config.json beside it)."""
    q = src.config_dict.get("quantization_config")
    where = f"{src.path / 'config.json'}: quantization_config"
    gptq_file = read_checkpoint_json(src.path, "quantize_config.json") if q is None else None
    if gptq_file is not None:
        q, where = {"quant_method": "gptq", **gptq_file}, str(src.path / "quantize_config.json")
    if not isinstance(q, dict):
        raise QliteError(f"{src.path / 'config.json'}: no quantization_config; a 16-bit checkpoint needs no import "
                         f"(qlite runs it as it is)")
    method = q.get("quant_method")
    if method not in SOURCES:
        raise QliteError(f"{where}: quant_method {method!r}; qlite imports {', '.join(SOURCES)}")
    return q, where


def import_checkpoint(src: str | Path, out: str | Path, force: bool = False, progress: bool = True) -> QuantConfig:
    """Convert a GPTQ or compressed-tensors Qwen2 checkpoint dir into a qlite checkpoint, exactly."""
    src_dir, out = CheckpointDir(src), Path(out).expanduser()
    check_output(out, force, inputs=(src_dir.path,))
    q, where = foreign_quantization(src_dir)
    source = SOURCES[q["quant_method"]](src_dir, q, where)
    base = {k: v for k, v in src_dir.config_dict.items() if k != "quantization_config"}
    cfg = ModelConfig.from_dict(base, source=str(src_dir.path / "config.json"))
    shapes16 = expected_tensors(cfg)
    modules = linear_modules(shapes16)
    names = list(shapes16)
    if "lm_head" not in modules and source.quantized("lm_head"):  # tied, with its own quantized head
        modules["lm_head"] = (cfg.vocab_size, cfg.hidden_size)
        names.append("lm_head.weight")
    formats = {m: source.module_format(m, shape[1]) for m, shape in modules.items() if source.quantized(m)}
    for m, fmt in formats.items():
        source.check(m, fmt, modules[m])
    orders = _orders(source, formats, modules)
    qcfg = _import_qconfig(formats, modules, source.method, where, any(o is not None for o in orders.values()))
    if qcfg.input_order:
        _check_fused_orders(src_dir, formats, orders)

    output, claimed = Output(), set()
    for name in names:
        module = name.removesuffix(".weight")
        if module not in formats:
            _check_float(src_dir, name)
            output.copy(src_dir, name)
            claimed.add(name)
            continue
        fmt, shape = formats[module], modules[module]
        specs = [TensorSpec(f"{module}.{s}", dt, sh) for s, (dt, sh) in fmt.stored_shapes(*shape).items()]
        if qcfg.input_order:
            specs.append(TensorSpec(f"{module}.input_order", torch.int32, (shape[1],)))
        output.jobs.append(Job(specs, lambda m=module, f=fmt, sh=shape: _imported(source, m, f, sh, qcfg.input_order)))
        claimed |= {f"{module}.{s}" for s in source.suffixes}
    extra = [n for n in src_dir.tensors if n not in claimed]
    if extra:
        raise QliteError(f"{src_dir.tensors[extra[0]].file}: unexpected tensor {extra[0]}")
    config = {**base, "quantization_config": qcfg.to_dict()}
    if "lm_head" in formats:
        config["tie_word_embeddings"] = False
    order = loading_order(output.specs(), ModelConfig.from_dict(config, source=str(src_dir.path / "config.json")))
    write_dir(src_dir, out, output, config, force, progress, "import", skip_files=("quantize_config.json",), specs=order,
              finish=lambda tmp: check_loads(tmp, out))
    return qcfg


def _check_float(src: CheckpointDir, name: str) -> None:
    if name not in src.tensors:
        raise QliteError(f"{src.path}: missing tensor {name}")
    info = src.tensors[name]
    if info.dtype not in FLOAT_STORAGE:
        raise QliteError(f"{info.file}: tensor {name} is {info.dtype}, expected a float type")


def _imported(source: ForeignSource, module: str, fmt: Format, shape, with_order: bool) -> dict[str, torch.Tensor]:
    stored, order = source.read(module, fmt, shape)
    out = {f"{module}.{s}": t for s, t in stored.items()}
    if with_order:
        out[f"{module}.input_order"] = order if order is not None else torch.arange(shape[1], dtype=torch.int32)
    return out


def _orders(source: ForeignSource, formats: dict, modules: dict) -> dict[str, torch.Tensor | None]:
    """Each quantized module's act-order column order (None: groups in plain order), from g_idx alone."""
    orders = {}
    for m, fmt in formats.items():
        name = next((f"{m}.{s}" for s in ("g_idx", "weight_g_idx") if f"{m}.{s}" in source.src.tensors), None)
        orders[m] = None
        if name is not None:
            g_idx, k = source.src.read(name), modules[m][1]
            if tuple(g_idx.shape) != (k,) or g_idx.is_floating_point():
                raise QliteError(f"{source.src.path}: {name} is {g_idx.dtype} {tuple(g_idx.shape)}, expected {k} "
                                 f"integers")
            orders[m] = foreign.order_from_g_idx(g_idx, foreign.group_size_of(fmt, k), f"{source.src.path}: {name}")
    return orders


def _check_fused_orders(src: CheckpointDir, formats: dict, orders: dict) -> None:
    """qlite fuses q/k/v and gate/up: their act-order column orders must agree."""
    for m in formats:
        for group in FUSED_GROUPS:
            if kind(m) in group[1:]:
                first = m.replace(kind(m), group[0])
                a, b = orders.get(first), orders[m]
                if first in formats and ((a is None) != (b is None) or (a is not None and not torch.equal(a, b))):
                    raise QliteError(f"{src.path}: {m} and {first} have different act-order g_idx; qlite runs them "
                                     f"as one fused projection, which needs one column order")


def _import_qconfig(formats: dict[str, Format], modules: dict, method: str, where: str, input_order: bool
                    ) -> QuantConfig:
    """The QuantConfig that gives each module its imported format (refused when qlite cannot say it)."""
    decoder = {m: f for m, f in formats.items() if m != "lm_head"}
    if not decoder:
        raise QliteError(f"{where}: no quantized decoder linear found")
    kinds_quantized = {kind(m) for m in decoder}
    head = formats.get("lm_head")
    if len(set(decoder.values())) > 1:  # a mix (one config group per format): every decoder linear by name
        linears = tuple((m, formats.get(m)) for m in modules if m != "lm_head")
        main = Counter(decoder.values()).most_common(1)[0][0]
        qcfg = QuantConfig(main, head, method, params={"imported_from": method}, input_order=input_order,
                           module_formats=linears)
    else:
        skip = tuple(m for m in modules if m != "lm_head" and kind(m) in kinds_quantized and m not in decoder)
        qcfg = QuantConfig(next(iter(decoder.values())), head, method,
                           tuple(k for k in LINEAR_KINDS if k in kinds_quantized), skip, {"imported_from": method},
                           input_order)
    for m in modules:
        if qcfg.format_for(m) != formats.get(m):
            raise QliteError(f"{where}: {m}'s format cannot be expressed in qlite's quantization_config")
    return qcfg
