"""Streaming conversion of a checkpoint dir into a quantized one.

One tensor at a time: read it from the source safetensors, quantize it if it is a linear weight the
format covers (row chunks, so even a 150k-row lm_head stays small), write it, drop it. Output goes
to a temporary dir beside DST that is renamed into place only when complete; SRC is only read."""
from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from qlite.checkpoint import large_allocations_from_mmap
from qlite.config import Qwen2Config, read_json
from qlite.errors import QliteError
from qlite.memory import PeakAnonSampler, peak_rss_bytes
from qlite.formats import Format, module_format, pack_int4, quantization_config, validate_format
from qlite.safetensors_io import INDEX_NAME, TensorSpec, atomic_output_dir, tensor_index, write_sharded
from quantize.rtn import quantize_int4, quantize_int8, quantize_rows

WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


@dataclass
class Summary:
    out_dir: Path
    tensors: int
    quantized: int
    bytes_before: int
    bytes_after: int
    linear_bits_per_weight: float
    head_bits_per_weight: float | None
    seconds: float
    peak_anon_bytes: int
    peak_rss_bytes: int

    def __str__(self) -> str:
        mib = 2 ** 20
        return (f"wrote {self.out_dir}: {self.tensors} tensors ({self.quantized} quantized), "
                f"{self.bytes_before / mib:.1f} MiB -> {self.bytes_after / mib:.1f} MiB, "
                f"{self.linear_bits_per_weight:.3f} bits per weight in the decoder linears"
                + (f", {self.head_bits_per_weight:.3f} in lm_head" if self.head_bits_per_weight else ", lm_head 16-bit")
                + f", {self.seconds:.1f} s, peak memory {self.peak_anon_bytes / mib:.0f} MiB anonymous "
                f"({self.peak_rss_bytes / mib:.0f} MiB RSS with mapped source pages)")


def quantize_weight(w: torch.Tensor, fmt: Format) -> dict[str, torch.Tensor]:
    """A float weight [N, K] -> the stored tensors of its format."""
    if fmt.scheme == "nf4":
        from quantize.bnb import quantize_nf4
        q, absmax = quantize_rows(w, quantize_nf4, blocksize=fmt.group_size)
        return {"qweight": q, "absmax": absmax}
    if fmt.scheme == "llm.int8":
        from quantize.bnb import quantize_llm_int8
        q, scb = quantize_rows(w, quantize_llm_int8)
        return {"qweight": q, "scb": scb}
    if fmt.bits == 8:
        q, s = quantize_rows(w, quantize_int8, group_size=fmt.group_size)
        return {"qweight": q, "scales": s}
    q, s, z = quantize_rows(w, quantize_int4, group_size=fmt.group_size, symmetric=fmt.symmetric)
    return {"qweight": pack_int4(q), "scales": s, "zeros": z}


def read_source_tensors(src: Path) -> list[tuple[Path, str, torch.dtype, tuple[int, ...]]]:
    """(file, name, dtype, shape) of every source tensor, from the safetensors headers alone."""
    dtypes = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
    out = []
    for path, name, dtype, shape in tensor_index(src):
        if dtype not in dtypes:
            raise QliteError(f"{path}: tensor {name} is {dtype}, expected a float checkpoint")
        out.append((path, name, dtypes[dtype], shape))
    return out


def expected_names(cfg: Qwen2Config) -> dict[str, tuple[int, ...]]:
    from qlite.model import Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg)
    names = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        names.pop("lm_head.weight")
    return names


def default_out_dir(src: Path, qcfg: dict) -> Path:
    main = module_format({**qcfg, "skip": []}, "model.layers.0.self_attn.q_proj")
    suffix = main.name if qcfg.get("method", "rtn") in ("rtn", "bnb") else f"{qcfg['method']}-{main.name}"
    if qcfg.get("act_order"):
        suffix += "-act"
    return src.parent / f"{src.name}-{suffix}"


def convert(src: str | Path, out: str | Path | None = None, bits: int = 4, group_size: int | None = 128,
            symmetric: bool = False, skip: tuple[str, ...] = (), lm_head_bits: int | None = None, force: bool = False,
            max_shard_bytes: int = 2 << 30, progress: bool = True, method: str = "rtn",
            weights: dict | None = None, extra_config: dict | None = None, scheme: str = "int") -> Summary:
    """Quantize the checkpoint dir `src` into `out` (default: src plus a suffix such as -int4-g128).
    scheme "nf4" or "llm.int8" makes bitsandbytes' formats (lm_head 16-bit by default, as
    transformers does for them); `weights` may supply already-quantized tensors by name (GPTQ does).
    Others are quantized by RTN."""
    t0 = time.perf_counter()
    large_allocations_from_mmap()  # freed tensors go back to the OS at once: memory stays one tensor deep
    src = Path(src).resolve() if Path(src).exists() else Path(src)
    if not src.is_dir():
        raise QliteError(f"{src}: not a directory")
    cfg_dict = read_json(src / "config.json")
    cfg = Qwen2Config.from_dict(cfg_dict, source=str(src / "config.json"))
    if cfg.quantization_config is not None:
        raise QliteError(f"{src / 'config.json'}: already quantized; quantize the 16-bit checkpoint")
    if lm_head_bits is None:
        lm_head_bits = 8 if scheme == "int" else 16
    if lm_head_bits not in (4, 8, 16):
        raise QliteError(f"--lm-head-bits {lm_head_bits}: choose 4, 8 or 16")
    fmt = validate_format(bits, group_size, symmetric, scheme)
    if scheme != "int":
        method = "bnb"
    qcfg = quantization_config(fmt, lm_head_bits, tuple(skip), method=method, extra=extra_config)
    out = Path(out) if out is not None else default_out_dir(src, qcfg)
    if out.resolve() == src or src in out.resolve().parents:
        raise QliteError(f"--out {out}: must not be SRC or inside it")
    if out.exists() and not force:
        raise QliteError(f"{out}: already exists (use --force to replace it)")

    source = read_source_tensors(src)
    expected = expected_names(cfg)
    have = {name: shape for _, name, _, shape in source}
    for name, shape in expected.items():
        if name not in have:
            raise QliteError(f"{src}: missing tensor {name}")
        if have[name] != shape:
            raise QliteError(f"{src}: tensor {name} has shape {have[name]}, the config implies {shape}")
    for name in have:
        if name not in expected:
            raise QliteError(f"{src}: unexpected tensor {name}")

    # The plan: each output tensor's spec, and how to make it from which source tensor.
    jobs = [(path, name, name, dtype, shape) for path, name, dtype, shape in source]
    if cfg.tie_word_embeddings and module_format(qcfg, "lm_head") is not None:
        emb = next(j for j in jobs if j[1] == "model.embed_tokens.weight")
        jobs.append((emb[0], emb[1], "lm_head.weight", emb[3], emb[4]))  # lm_head gets its own quantized copy
    specs, plan = [], []
    n_weights = n_bits = 0
    head_bits = None
    for path, src_name, out_name, dtype, shape in jobs:
        module = out_name.removesuffix(".weight")
        fmt_m = module_format(qcfg, module) if out_name.endswith(".weight") and len(shape) == 2 else None
        if fmt_m is None:
            specs.append(TensorSpec(out_name, dtype, shape))
        else:
            fmt_m.check(shape[1], module)
            for suffix, (qdtype, qshape) in fmt_m.stored_shapes(*shape).items():
                specs.append(TensorSpec(f"{module}.{suffix}", qdtype, qshape))
            if module == "lm_head":
                head_bits = fmt_m.bits_per_weight(shape[1])
            else:
                n_weights += shape[0] * shape[1]
                n_bits += fmt_m.bits_per_weight(shape[1]) * shape[0] * shape[1]
        plan.append((path, src_name, module, fmt_m))

    def produce():
        from safetensors import safe_open
        from tqdm import tqdm

        for path, src_name, module, fmt_m in tqdm(plan, desc="quantize", unit="tensor", disable=not progress):
            if fmt_m is not None and weights is not None and f"{module}.qweight" in weights:
                stored = {k: weights[f"{module}.{k}"] for k in fmt_m.stored_shapes(1, 1)}
            else:
                with safe_open(path, framework="pt") as f:  # opened per tensor: its mapping goes with it
                    w = f.get_tensor(src_name)
                if fmt_m is None:
                    yield src_name, w
                    continue
                stored = quantize_weight(w, fmt_m)
                del w
            for suffix, t in stored.items():
                yield f"{module}.{suffix}", t

    with PeakAnonSampler() as mem, atomic_output_dir(out, force=force) as tmp:
        write_sharded(tmp, specs, produce(), max_shard_bytes=max_shard_bytes, metadata={"format": "pt"})
        for f in src.iterdir():  # tokenizer, generation config, chat template, ...
            if f.is_file() and f.name not in ("config.json", INDEX_NAME) and not f.name.endswith(WEIGHT_FILES):
                shutil.copy2(f, tmp / f.name)
        (tmp / "config.json").write_text(json.dumps({**cfg_dict, "quantization_config": qcfg}, indent=2))

    before = sum(TensorSpec(n, d, s).nbytes for _, n, d, s in source)
    return Summary(out, len(specs), sum(1 for p in plan if p[3] is not None), before,
                   sum(s.nbytes for s in specs), n_bits / max(n_weights, 1), head_bits, time.perf_counter() - t0,
                   mem.peak, peak_rss_bytes())
