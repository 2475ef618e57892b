"""GPTQ over a whole checkpoint, one decoder layer at a time, in bounded memory.

Calibration token windows go through the embedding; then for each layer: load its weights alone,
run the current activations through it while hooks accumulate each linear's Hessian, quantize each
linear with GPTQ, put the dequantized weights back, and run the activations through again: the
quantized layer's outputs are the next layer's inputs. lm_head is quantized last, on the final-norm
outputs. Only one layer and the activations are in memory; the result is written by the streaming
converter in the same format as RTN.

Built-in calibration text (disjoint from eval/data.py's eval text): half Python standard-library
source (CALIB_MODULES), half English prose from the reference text in Python's pydoc_data package."""
from __future__ import annotations

import time
from pathlib import Path

import torch

from qlite.config import load_config
from qlite.errors import QliteError
from qlite.memory import PeakAnonSampler
from qlite.formats import (Format, dequantize_int4, dequantize_int8, module_format, quantization_config,
                           validate_format)
from qlite.model import DecoderLayer, RMSNorm, Rotary
from qlite.safetensors_io import tensor_index
from qlite.tokenizer import Tokenizer
from quantize.gptq import gptq_linear, hessian_update

CALIB_MODULES = ("inspect", "typing", "dataclasses", "pathlib", "functools", "enum", "tarfile", "csv",
                 "logging", "ast")
# Linears by shared input: q/k/v read the same normed hidden state, gate/up too: one Hessian each.
INPUT_GROUPS = {"self_attn.q_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                "self_attn.o_proj": ("self_attn.o_proj",),
                "mlp.gate_proj": ("mlp.gate_proj", "mlp.up_proj"),
                "mlp.down_proj": ("mlp.down_proj",)}
BATCH = 4  # calibration windows per forward


def builtin_calibration_texts() -> tuple[str, str]:
    """(code, prose) built-in calibration text."""
    from pydoc_data.topics import topics

    from eval.data import module_source
    code = "\n\n".join(f"# file: {m}.py\n{module_source(m)}" for m in CALIB_MODULES)
    prose = "\n\n".join(topics[k] for k in sorted(topics))
    return code, prose


def windows(ids: list[int], count: int, seqlen: int) -> list[list[int]]:
    """`count` windows of seqlen tokens, evenly spaced over the token stream."""
    if len(ids) < seqlen:
        raise QliteError(f"calibration text has {len(ids)} tokens, fewer than --seqlen {seqlen}")
    if count <= 0:
        return []
    step = (len(ids) - seqlen) / max(count - 1, 1)
    return [ids[int(i * step):int(i * step) + seqlen] for i in range(count)]


def calibration_ids(tokenizer: Tokenizer, source: str, nsamples: int, seqlen: int) -> torch.Tensor:
    """(nsamples, seqlen) token ids: built-in half code, half prose; or windows of a text file."""
    if source == "builtin":
        code, prose = builtin_calibration_texts()
        rows = windows(tokenizer.encode(code), nsamples - nsamples // 2, seqlen)
        rows += windows(tokenizer.encode(prose), nsamples // 2, seqlen)
    else:
        from eval.data import load_text
        rows = windows(tokenizer.encode(load_text(source)), nsamples, seqlen)
    return torch.tensor(rows)


class TensorReader:
    """Tensors of a checkpoint dir by name, across shards, read one at a time as float32."""

    def __init__(self, model_dir: Path):
        self.where = {name: path for path, name, _, _ in tensor_index(model_dir)}

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open
        if name not in self.where:
            raise QliteError(f"missing tensor {name}")
        with safe_open(self.where[name], framework="pt") as f:
            return f.get_tensor(name).float()


def dequantize_stored(stored: dict[str, torch.Tensor], fmt: Format, in_features: int) -> torch.Tensor:
    if fmt.bits == 8:
        return dequantize_int8(stored["qweight"], stored["scales"])
    return dequantize_int4(stored["qweight"], stored["scales"], stored["zeros"], in_features)


def run_batched(fn, x: torch.Tensor, in_place: bool = False) -> None:
    """fn over the windows of x, BATCH at a time; in_place: each batch's output replaces its input
    (windows are independent), so the activations are never held twice."""
    for i in range(0, x.shape[0], BATCH):
        y = fn(x[i:i + BATCH])
        if in_place:
            x[i:i + BATCH] = y


@torch.inference_mode()
def gptq_weights(src: Path, qcfg: dict, calib: str, nsamples: int, seqlen: int, act_order: bool, damp: float,
                 progress: bool = True) -> dict[str, torch.Tensor]:
    """The stored tensors of every linear the config quantizes, by GPTQ."""
    from tqdm import tqdm

    cfg = load_config(src)
    reader = TensorReader(src)
    ids = calibration_ids(Tokenizer(src), calib, nsamples, seqlen)  # (n, seqlen)
    x = torch.nn.functional.embedding(ids, reader.get("model.embed_tokens.weight"))  # (n, seqlen, hidden)
    positions = torch.arange(seqlen)[None]  # (1, seqlen)
    cos, sin = Rotary(cfg.head_dim, cfg.rope_theta)(positions, torch.float32)
    out: dict[str, torch.Tensor] = {}

    def quantize_linear(name: str, linear: torch.nn.Linear, hessian: torch.Tensor, update: bool = True) -> None:
        """GPTQ one linear; with update, its weight becomes the dequantized result (for the next pass)."""
        fmt = module_format(qcfg, name)
        if fmt is None:
            return
        fmt.check(linear.in_features, name)
        stored = gptq_linear(linear.weight, hessian, fmt, damp=damp, act_order=act_order)
        out.update({f"{name}.{k}": v for k, v in stored.items()})
        if update:
            linear.weight.copy_(dequantize_stored(stored, fmt, linear.in_features))

    for i in tqdm(range(cfg.num_hidden_layers), desc="gptq", unit="layer", disable=not progress):
        prefix = f"model.layers.{i}."
        layer = DecoderLayer(cfg)
        layer.load_state_dict({k: reader.get(prefix + k) for k in layer.state_dict()})
        modules = dict(layer.named_modules())
        hessians = {n: torch.zeros(modules[n].in_features, modules[n].in_features) for n in INPUT_GROUPS}
        hooks = [modules[n].register_forward_hook(lambda m, inp, _, n=n: hessian_update(hessians[n], inp[0]))
                 for n in INPUT_GROUPS]
        run_batched(lambda xb: layer(xb, cos, sin, None, 0, None), x)
        for h in hooks:
            h.remove()
        for first, group in INPUT_GROUPS.items():
            hessian = hessians.pop(first)
            for n in group:
                quantize_linear(prefix + n, modules[n], hessian)
        run_batched(lambda xb: layer(xb, cos, sin, None, 0, None), x, in_place=True)  # the quantized layer's outputs

    norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    norm.weight.copy_(reader.get("model.norm.weight"))
    x = norm(x)
    head_name = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    head.weight = torch.nn.Parameter(reader.get(head_name), requires_grad=False)
    hessian = torch.zeros(cfg.hidden_size, cfg.hidden_size)
    hessian_update(hessian, x)
    del x
    quantize_linear("lm_head", head, hessian, update=False)
    return out


def gptq_convert(src, out=None, bits: int = 4, group_size: int | None = 128, symmetric: bool = False,
                 skip: tuple[str, ...] = (), lm_head_bits: int | None = None, calib: str = "builtin",
                 nsamples: int = 128, seqlen: int = 512, act_order: bool = False, damp: float = 0.01,
                 force: bool = False, max_shard_bytes: int = 2 << 30, progress: bool = True):
    """Quantize a checkpoint dir with GPTQ; returns the converter's Summary."""
    from quantize.convert import convert, default_out_dir

    src = Path(src)
    if nsamples < 1 or seqlen < 2:
        raise QliteError("--nsamples must be >= 1 and --seqlen >= 2")
    if not damp > 0:
        raise QliteError(f"--damp {damp}: must be > 0")
    lm_head_bits = 8 if lm_head_bits is None else lm_head_bits
    fmt = validate_format(bits, group_size, symmetric)
    extra = {"act_order": act_order, "damp": damp, "nsamples": nsamples, "seqlen": seqlen, "calibration": calib}
    qcfg = quantization_config(fmt, lm_head_bits, tuple(skip), method="gptq", extra=extra)
    out = Path(out) if out is not None else default_out_dir(src.resolve(), qcfg)
    if out.exists() and not force:
        raise QliteError(f"{out}: already exists (use --force to replace it)")
    t0 = time.perf_counter()
    with PeakAnonSampler() as mem:
        weights = gptq_weights(src, qcfg, calib, nsamples, seqlen, act_order, damp, progress)
    summary = convert(src, out, bits=bits, group_size=group_size, symmetric=symmetric, skip=skip,
                      lm_head_bits=lm_head_bits, force=force, max_shard_bytes=max_shard_bytes, progress=progress,
                      method="gptq", weights=weights, extra_config=extra)
    summary.seconds = time.perf_counter() - t0
    summary.peak_anon_bytes = max(summary.peak_anon_bytes, mem.peak)
    return summary
