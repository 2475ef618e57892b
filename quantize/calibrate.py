"""The calibrated methods over a whole checkpoint, one decoder layer at a time, in bounded memory:
GPTQ (quantize/gptq.py), and act-rtn, round to nearest on activation-aware grids (quantize/act_grid.py).

Calibration token windows go through the embedding; then for each layer: load its weights alone,
run the current activations through it while hooks accumulate each linear's Hessian (the fused
q/k/v and gate/up projections read one input each, so one Hessian serves their parts), quantize each
part (GPTQ or act-rtn), put the dequantized weights back, and run the activations through again: the
quantized layer's outputs are the next layer's inputs. lm_head is quantized last, on the final-norm
outputs. Only one layer and the activations are in memory; the result is written by the streaming
converter's writer in the same format as RTN.

Built-in calibration text: qlite/texts.py (half code, half prose; disjoint from the eval text)."""
from __future__ import annotations

import dataclasses
import time

import torch

from qlite.checkpoint import CheckpointDir
from qlite.errors import QliteError
from qlite.memory import PeakAnonSampler, available_bytes
from qlite.loader import float_layer
from qlite.model import Linear, RMSNorm, Rotary, Step, linear_parts
from qlite.qconfig import DAMP, QuantConfig
from qlite.texts import calibration_texts, load_text
from qlite.tokenizer import Tokenizer
from quantize.convert import Summary, plan_conversion, source_and_output, write_quantized
from quantize.act_grid import act_quantize
from quantize.gptq import gptq_linear, hessian_update

BATCH = 4  # calibration windows per forward


def windows(ids: list[int], count: int, seqlen: int) -> list[list[int]]:
    """`count` windows of seqlen tokens, evenly spaced over the token stream."""
    if len(ids) < seqlen:
        raise QliteError(f"calibration text has {len(ids)} tokens, fewer than --seqlen {seqlen}")
    if count <= 0:
        return []
    step = (len(ids) - seqlen) / max(count - 1, 1)
    return [ids[int(i * step):int(i * step) + seqlen] for i in range(count)]


CALIB_BYTES_PER_TOKEN_AND_WIDTH = 8  # float32 activations, in and out of a layer
CALIB_BYTES_PER_TOKEN = 64  # the token ids on their way to a tensor


def check_calibration_memory(nsamples: int, seqlen: int, hidden: int) -> None:
    """The calibration windows' activations stay in memory through every layer: refuse up front,
    naming the flags, what the machine cannot hold (rather than swapping or dying of OOM)."""
    need = nsamples * seqlen * (CALIB_BYTES_PER_TOKEN_AND_WIDTH * hidden + CALIB_BYTES_PER_TOKEN)
    free = available_bytes()
    if free is not None and need > free:
        raise QliteError(f"--nsamples {nsamples} --seqlen {seqlen}: the calibration activations need about "
                         f"{need / 2**30:.1f} GiB, more than the {free / 2**30:.1f} GiB this machine has available")


def calibration_ids(tokenizer: Tokenizer, source: str, nsamples: int, seqlen: int, hidden: int) -> torch.Tensor:
    """(nsamples, seqlen) token ids: built-in half code, half prose; or windows of a text file.
    hidden: the model's width, for check_calibration_memory."""
    check_calibration_memory(nsamples, seqlen, hidden)
    if source == "builtin":
        code, prose = calibration_texts()
        rows = windows(tokenizer.encode(code), nsamples - nsamples // 2, seqlen)
        rows += windows(tokenizer.encode(prose), nsamples // 2, seqlen)
    else:
        rows = windows(tokenizer.encode(load_text(source, flag="--calib-data")), nsamples, seqlen)
    return torch.tensor(rows)


def run_batched(fn, x: torch.Tensor, in_place: bool = False) -> None:
    """fn over the windows of x, BATCH at a time; in_place: each batch's output replaces its input
    (windows are independent), so the activations are never held twice."""
    for i in range(0, x.shape[0], BATCH):
        y = fn(x[i:i + BATCH])
        if in_place:
            x[i:i + BATCH] = y


METHODS = ("gptq", "act-rtn")


@torch.inference_mode()
def calibrated_weights(src: CheckpointDir, qconfig: QuantConfig, method: str, calib: str, nsamples: int, seqlen: int,
                       act_order: bool, damp: float, progress: bool = True) -> dict[str, dict[str, torch.Tensor]]:
    """The stored tensors of every linear the config quantizes, by `method` (gptq, act-rtn), by module name."""
    from tqdm import tqdm

    cfg = dataclasses.replace(src.config, quantization=None)  # the float layers the methods work on
    ids = calibration_ids(Tokenizer(src.path), calib, nsamples, seqlen, cfg.hidden_size)  # (n, seqlen)
    x = torch.nn.functional.embedding(ids, src.read("model.embed_tokens.weight").float())  # (n, seqlen, hidden)
    step = Step(*Rotary(cfg)(torch.arange(seqlen)[None]), None, None, 0)
    out: dict[str, dict[str, torch.Tensor]] = {}

    def quantize_linear(name: str, linear: torch.nn.Linear, hessian: torch.Tensor, update: bool = True) -> None:
        """Quantize each part of one linear; with update, its weight becomes the dequantized result."""
        row = 0
        for module, rows in linear_parts(name, linear):
            weight, row = linear.weight[row:row + rows], row + rows
            fmt = qconfig.format_for(module)
            if fmt is None:
                continue
            out[module] = (gptq_linear(weight, hessian, fmt, damp=damp, act_order=act_order) if method == "gptq"
                           else act_quantize(weight, hessian, fmt, damp=damp))
            if update:
                weight.copy_(fmt.dequantize(out[module], linear.in_features))

    for i in tqdm(range(cfg.num_hidden_layers), desc=method, unit="layer", disable=not progress):
        prefix = f"model.layers.{i}."
        layer = float_layer(src, cfg, i)
        linears = {n: m for n, m in layer.named_modules() if isinstance(m, Linear)}
        hessians = {n: torch.zeros(m.in_features, m.in_features) for n, m in linears.items()}
        hooks = [m.register_forward_hook(lambda m, inp, _, n=n: hessian_update(hessians[n], inp[0]))
                 for n, m in linears.items()]
        run_batched(lambda xb: layer(xb, step), x)
        for h in hooks:
            h.remove()
        for n, m in linears.items():
            quantize_linear(prefix + n, m, hessians.pop(n))
        run_batched(lambda xb: layer(xb, step), x, in_place=True)  # the quantized layer's outputs

    norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    norm.weight.copy_(src.read("model.norm.weight").float())
    x = norm(x)
    head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    head.weight = torch.nn.Parameter(src.read("model.embed_tokens.weight" if cfg.tie_word_embeddings
                                              else "lm_head.weight").float(), requires_grad=False)
    hessian = torch.zeros(cfg.hidden_size, cfg.hidden_size)
    hessian_update(hessian, x)
    del x
    quantize_linear("lm_head", head, hessian, update=False)
    return out


def calibration_params(calib: str, nsamples: int, seqlen: int, act_order: bool, damp: float) -> dict:
    """The calibrated methods' settings as a checkpoint records them (quantization_config)."""
    return {"act_order": act_order, "damp": damp, "nsamples": nsamples, "seqlen": seqlen, "calibration": calib}


def calibrated_convert(src, out=None, qconfig: QuantConfig | None = None, *, method: str = "gptq",
                       calib: str = "builtin", nsamples: int = 128, seqlen: int = 512, act_order: bool = False,
                       damp: float = DAMP, force: bool = False, max_shard_bytes: int = 2 << 30, progress: bool = True,
                       report: bool = True, **options) -> Summary:
    """Quantize a checkpoint dir with GPTQ or act-rtn (`method`; formats from `qconfig` or
    QuantConfig.from_options(**options), as for convert); returns the converter's Summary."""
    if method not in METHODS:
        raise ValueError(f"calibrated method {method!r}: one of {METHODS}")
    if act_order and method != "gptq":
        raise QliteError("--act-order: a GPTQ setting (--method gptq)")
    if nsamples < 1 or seqlen < 2:
        raise QliteError("--nsamples must be >= 1 and --seqlen >= 2")
    if not damp > 0:
        raise QliteError(f"--damp {damp}: must be > 0")
    params = calibration_params(calib, nsamples, seqlen, act_order, damp)
    qconfig = qconfig or QuantConfig.from_options(method=method, params=params, **options)
    for fmt in (qconfig.linear, qconfig.lm_head, qconfig.embeddings):
        if fmt is not None and not fmt.calibrated:
            raise QliteError(f"--method {method} makes qlite's int formats, not {fmt.name}")
    t0 = time.perf_counter()
    src, out = source_and_output(src, out, qconfig, force)
    plan = plan_conversion(src, qconfig, report)  # everything checked before the long calibration
    if seqlen > src.config.max_position_embeddings:
        raise QliteError(f"--seqlen {seqlen}: longer than the model's context {src.config.max_position_embeddings}")
    with PeakAnonSampler() as mem:
        weights = calibrated_weights(plan.src, qconfig, method, calib, nsamples, seqlen, act_order, damp, progress)
        written = write_quantized(plan, out, lambda job: weights.pop(job.module) if job.module in weights
                                  else job.fmt.quantize(plan.src.read(job.source)),  # embeddings: round to nearest
                                  force, max_shard_bytes, progress, report)
    return plan.summary(out, time.perf_counter() - t0, mem.peak, written)
