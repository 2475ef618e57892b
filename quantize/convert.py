"""Streaming conversion of a checkpoint dir into a quantized one, in two steps:

- plan: check the source (every name and shape the config implies, float tensors, not already
  quantized), decide each output tensor (copied, or quantized in which format) and the output specs;
- write: one tensor at a time, read it from the source, quantize it if the plan says so (the
  quantize function is RTN's or a calibrated method's), write it, drop it. Output goes to a temporary dir beside
  DST that is renamed into place only when complete; SRC is only read.

`convert` (round to nearest, or bitsandbytes for its formats) and quantize.calibrate's
`calibrated_convert` (GPTQ, act-rtn) are the two quantize functions behind the same plan and writer."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from qlite.checkpoint import FLOAT_STORAGE, CheckpointDir
from qlite.errors import QliteError
from qlite.formats import Format
from qlite.info import REPORT_NAME
from qlite.loader import check_loads
from qlite.memory import PeakAnonSampler, large_allocations_from_mmap, peak_rss_bytes
from qlite.decoder.causal_lm import CausalLM
from qlite.decoder.names import checkpoint_layout, checkpoint_shapes
from qlite.outputs import check_output
from qlite.qconfig import EMBEDDINGS, QuantConfig
from qlite.safetensors_io import TensorSpec, made_in_order, write_checkpoint_dir

PARTS = {"lm_head": "lm_head", EMBEDDINGS: "embeddings"}  # output module -> part; any other: "linears"


def quantize_tensor(src: CheckpointDir, job) -> dict[str, torch.Tensor]:
    """One job's source tensor in its format (round to nearest); a failure names the tensor."""
    try:
        return job.fmt.quantize(src.read(job.source))
    except QliteError as e:
        raise QliteError(f"{src.tensors[job.source].file}: tensor {job.source}: {e}") from None


@dataclass(frozen=True)
class Job:
    source: str  # the source tensor
    module: str  # the output module, or tensor if copied (lm_head for a tied checkpoint's own head)
    fmt: Format | None  # None: copied as is


@dataclass
class Plan:
    src: CheckpointDir
    qconfig: QuantConfig
    jobs: list[Job]
    specs: list[TensorSpec]  # in the order written
    side_files: list[Path]  # copied as they are: tokenizer, generation config, chat template, ...
    made_by: dict[str, Job]  # output tensor name -> the job that makes it

    def bits_per_weight(self, part: str) -> float | None:
        """Stored bits per weight of the quantized decoder linears ("linears"), lm_head or the
        embeddings; None where that part is not quantized."""
        n = bits = 0
        for job in self.jobs:
            if job.fmt is not None and PARTS.get(job.module, "linears") == part:
                rows, cols = self.src.tensors[job.source].shape
                n += rows * cols
                bits += job.fmt.bits_per_weight(cols) * rows * cols
        return bits / n if n else None

    def summary(self, out_dir: Path, seconds: float, peak_anon: int, report: dict | None = None) -> "Summary":
        params = sum(math.prod(info.shape) for info in self.src.tensors.values())
        return Summary(out_dir, len(self.specs), sum(j.fmt is not None for j in self.jobs), self.src.nbytes,
                       sum(s.nbytes for s in self.specs), params, self.bits_per_weight("linears") or 16.0,
                       self.bits_per_weight("lm_head"), self.bits_per_weight("embeddings"),
                       self.qconfig.shares_table(self.src.config.tie_word_embeddings), seconds, peak_anon,
                       peak_rss_bytes(), (report or {}).get("fidelity"), (report or {}).get("not_measured"))


@dataclass
class Summary:
    out_dir: Path
    tensors: int
    quantized: int
    bytes_before: int
    bytes_after: int
    parameters: int  # of the source (a tied table counted once)
    linear_bits_per_weight: float
    head_bits_per_weight: float | None  # None: 16-bit, or the shared table
    embed_bits_per_weight: float | None  # None: 16-bit
    head_is_table: bool  # a tied head that uses the stored embedding table
    seconds: float
    peak_anon_bytes: int
    peak_rss_bytes: int
    fidelity: dict | None = None  # the report's measurement (None: not measured)
    not_measured: str | None = None  # why not

    @property
    def bits_per_parameter(self) -> float:
        """Every stored byte of the output's tensors, times 8, over the parameter count."""
        return 8 * self.bytes_after / self.parameters

    def __str__(self) -> str:
        mib = 2 ** 20
        return (f"wrote {self.out_dir}: {self.tensors} tensors ({self.quantized} quantized), "
                f"{self.bytes_before / mib:.1f} MiB -> {self.bytes_after / mib:.1f} MiB, "
                f"{self.bits_per_parameter:.3f} bits per parameter; bits per weight: "
                f"{self.linear_bits_per_weight:.3f} in the decoder linears"
                + (f", {self.embed_bits_per_weight:.3f} in the embeddings" if self.embed_bits_per_weight
                   else ", embeddings 16-bit")
                + (", lm_head is the embedding table" if self.head_is_table
                   else f", {self.head_bits_per_weight:.3f} in lm_head" if self.head_bits_per_weight else ", lm_head 16-bit")
                + f", {self.seconds:.1f} s, peak memory {self.peak_anon_bytes / mib:.0f} MiB anonymous "
                f"({self.peak_rss_bytes / mib:.0f} MiB RSS with mapped source pages)" + self.fidelity_text())

    def fidelity_text(self) -> str:
        if self.fidelity is None:
            return f"\nfidelity not measured ({self.not_measured or '--no-report'})"
        texts = ", ".join(f"{text} KLD {m['kld_mean']:.4f}, top-1 {100 * m['top1']:.1f}%, PPL ratio {m['ppl_ratio']:.3f}"
                          for text, m in self.fidelity["texts"].items())
        return (f"\nfidelity against the source ({self.fidelity['chunks']} x {self.fidelity['ctx']} tokens of each "
                f"built-in text, {self.fidelity['seconds']:.0f} s): {texts}; in {REPORT_NAME}")


def expected_tensors(cfg) -> dict[str, tuple[int, ...]]:
    """The checkpoint names and shapes, in the loader's order, that a checkpoint of this config holds
    (16-bit when cfg has no quantization)."""
    with torch.device("meta"):
        model = CausalLM(cfg)
    return checkpoint_shapes(checkpoint_layout(model))


def plan_conversion(src: CheckpointDir, qconfig: QuantConfig, report: bool = False) -> Plan:
    """report: the source must also hold what the fidelity report reads (its tokenizer)."""
    cfg = src.config
    if cfg.quantization is not None:
        raise QliteError(f"{src.path / 'config.json'}: already quantized; quantize the 16-bit checkpoint")
    src.check_tensors(expected_tensors(cfg))
    for name, info in src.tensors.items():
        if info.dtype not in FLOAT_STORAGE:
            raise QliteError(f"{info.file}: tensor {name} is {info.dtype}, expected a float checkpoint")
    jobs = []
    for name, info in src.tensors.items():
        module = name.removesuffix(".weight")
        fmt = qconfig.format_for(module) if name.endswith(".weight") and len(info.shape) == 2 else None
        jobs.append(Job(name, module if fmt else name, fmt))
    linears = [name.removesuffix(".weight") for name, info in src.tensors.items()
               if name.endswith(".weight") and len(info.shape) == 2 and "embed_tokens" not in name] + ["lm_head"]
    for s in qconfig.skip:
        if not any(s in m for m in linears):
            raise QliteError(f"--skip {s}: names no linear layer of {src.path} (names look like "
                             f"model.layers.0.mlp.down_proj; any part of one will do, e.g. down_proj)")
    if cfg.tie_word_embeddings and not qconfig.shares_table(True):  # the head in its own format
        head = qconfig.format_for("lm_head")
        jobs.append(Job("model.embed_tokens.weight", "lm_head" if head else "lm_head.weight", head))
    specs, made_by = [], {}
    for job in jobs:
        info = src.tensors[job.source]
        if job.fmt is None:
            specs.append(TensorSpec(job.module, info.torch_dtype, info.shape))
            made_by[job.module] = job
            continue
        try:
            job.fmt.check(info.shape[1], job.module)
        except QliteError as e:
            raise QliteError(f"--group-size: {e}") from None
        for suffix, (dtype, shape) in job.fmt.stored_shapes(*info.shape).items():
            specs.append(TensorSpec(f"{job.module}.{suffix}", dtype, shape))
            made_by[f"{job.module}.{suffix}"] = job
    if report:
        from .report import can_measure
        can_measure(src)
    return Plan(src, qconfig, jobs, loading_order(specs, replace(cfg, quantization=qconfig)), src.side_files(),
                made_by)


def loading_order(specs: list[TensorSpec], cfg) -> list[TensorSpec]:
    """`specs` in the order the loader takes them for a model of `cfg`: the parts of a fused
    projection (q, k, v; gate, up) back to back, so that each fused tensor is one view of the file."""
    order = {name: i for i, name in enumerate(expected_tensors(cfg))}
    return sorted(specs, key=lambda s: order.get(s.name, len(order)))


def source_and_output(src: str | Path, out: str | Path | None, qconfig: QuantConfig, force: bool
                      ) -> tuple[CheckpointDir, Path]:
    """The source dir, and --out or SRC plus the format's suffix beside SRC; never SRC or inside it."""
    src = Path(src).expanduser()
    src = CheckpointDir(src.resolve() if src.exists() else src)
    out = Path(out).expanduser() if out is not None else src.path.parent / f"{src.path.name}-{qconfig.suffix}"
    check_output(out, force, inputs=(src.path,))
    return src, out


def write_quantized(plan: Plan, out: Path, stored_for: Callable[[Job], dict[str, torch.Tensor]], force: bool = False,
                    max_shard_bytes: int = 2 << 30, progress: bool = True, fidelity: bool = True, ref=None) -> dict:
    """Write the plan's output dir; `stored_for(job)` gives a quantized job's stored tensors by suffix.
    The dir includes its report (quantize/report.py; fidelity: measured, against `ref` if a pass over
    the source made it; else recipe and sizes only), which is returned."""
    from .report import write_report

    large_allocations_from_mmap()  # freed tensors go back to the OS at once: memory stays one tensor deep

    def made(job: Job) -> dict[str, torch.Tensor]:  # a job's output tensors by name
        if job.fmt is None:
            return {job.module: plan.src.read(job.source)}
        return {f"{job.module}.{suffix}": t for suffix, t in stored_for(job).items()}

    def produce():
        from tqdm import tqdm

        with tqdm(total=len(plan.jobs), desc="quantize", unit="tensor", disable=not progress) as bar:
            yield from made_in_order(plan.specs, plan.made_by, made, bar.update)

    config = {**plan.src.config_dict, "quantization_config": plan.qconfig.to_dict()}
    return write_checkpoint_dir(out, plan.specs, produce(), config, inputs=(plan.src.path,), force=force,
                                side_files=plan.side_files, max_shard_bytes=max_shard_bytes,
                                finish=lambda tmp: check_loads(tmp, out) or write_report(plan, tmp, fidelity, ref))


def convert(src: str | Path, out: str | Path | None = None, qconfig: QuantConfig | None = None, *,
            force: bool = False, max_shard_bytes: int = 2 << 30, progress: bool = True, report: bool = True,
            ref=None, **options) -> Summary:
    """Quantize the checkpoint dir `src` into `out` (default: src plus a suffix such as -int4-g128) by
    round to nearest on each format's grid (bitsandbytes' own quantizer for its formats). The formats
    come from `qconfig`, or from QuantConfig.from_options(**options) (bits, group_size, symmetric,
    scheme, lm_head_bits, embed_bits, skip). report: measure fidelity for the report (quantize/report.py),
    against `ref` if a pass over the source already made its reference."""
    t0 = time.perf_counter()
    qconfig = qconfig or QuantConfig.from_options(**options)
    src, out = source_and_output(src, out, qconfig, force)
    plan = plan_conversion(src, qconfig, report)
    with PeakAnonSampler() as mem:
        written = write_quantized(plan, out, lambda job: quantize_tensor(plan.src, job), force,
                                  max_shard_bytes, progress, report, ref)
    return plan.summary(out, time.perf_counter() - t0, mem.peak, written)
