"""The calibrated methods over a whole checkpoint, one decoder layer at a time, in bounded memory:
GPTQ (quantize/gptq.py), and act-rtn, round to nearest on activation-aware grids (quantize/act_grid.py).

Calibration token windows go through the embedding; then for each layer (read once, in a pass over
the source that the report's reference rides: quantize/source_pass.py): run the current activations
through it while hooks accumulate each linear's Hessian (the fused q/k/v and gate/up projections read
one input each, so one Hessian serves their parts), quantize each part (GPTQ or act-rtn), put the
dequantized weights back, and run the activations through again: the quantized layer's outputs are the
next layer's inputs. lm_head is quantized last, on the final-norm outputs. Only one layer and the
activations are in memory; the result is written by the streaming converter's writer in the same
format as RTN.

Built-in calibration text: qlite/texts.py (half code, half prose; disjoint from the eval text)."""
from __future__ import annotations

import time

import torch

from qlite.checkpoint import CheckpointDir
from qlite.errors import QliteError
from qlite.memory import PeakAnonSampler, available_bytes
from qlite.decoder.linear import Linear
from qlite.decoder.mlp import SparseMLP
from qlite.decoder.names import linear_parts
from qlite.qconfig import DAMP, QuantConfig
from qlite.texts import calibration_texts, coding_conversations, load_text
from qlite.tokenizer import Tokenizer
from quantize.report import can_measure, reference
from quantize.convert import Summary, plan_conversion, source_and_output, write_quantized
from quantize.act_grid import act_quantize
from quantize.gptq import Hessian, gptq_linear, hessian_of
from quantize.source_pass import Windows, embedded, final_norm, head_weight, source_pass

BATCH = 4  # calibration windows per forward
FEW_TOKENS = 64  # an expert routed fewer calibration tokens is calibrated on all (few_tokens_experts)
FEW_TOKENS_BATCH = 4096  # tokens per product when it is


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


def chat_text(tokenizer: Tokenizer) -> str:
    """Coding conversations (qlite/texts.py coding_conversations: the built-in code tasks asked as
    `qlite eval --tasks` asks them, answered with their reference code) in the checkpoint's own chat
    template: what a chat model reads when it writes code, rather than plain text."""
    if tokenizer.chat_template is None:
        raise QliteError("--calib-data chat: the checkpoint has no chat template to render conversations with")
    return "".join(tokenizer.apply_chat_template([{"role": "user", "content": question},
                                                  {"role": "assistant", "content": answer}], add_generation_prompt=False)
                   for question, answer in coding_conversations())


def calibration_ids(tokenizer: Tokenizer, source: str, nsamples: int, seqlen: int, hidden: int) -> torch.Tensor:
    """(nsamples, seqlen) token ids: built-in half code, half prose; `chat`, coding conversations
    (chat_text); or windows of a text file. hidden: the model's width, for check_calibration_memory."""
    check_calibration_memory(nsamples, seqlen, hidden)
    if source == "builtin":
        code, prose = calibration_texts()
        rows = windows(tokenizer.encode(code), nsamples - nsamples // 2, seqlen)
        rows += windows(tokenizer.encode(prose), nsamples // 2, seqlen)
    elif source == "chat":
        rows = windows(tokenizer.encode(chat_text(tokenizer)), nsamples, seqlen)
    else:
        rows = windows(tokenizer.encode(load_text(source, flag="--calib-data")), nsamples, seqlen)
    return torch.tensor(rows)


METHODS = ("gptq", "act-rtn")


@torch.inference_mode()
def calibrated_weights(src: CheckpointDir, qconfig: QuantConfig, method: str, calib: str, nsamples: int, seqlen: int,
                       act_order: bool, damp: float, progress: bool = True, riders: tuple[Windows, ...] = ()
                       ) -> dict[str, dict[str, torch.Tensor]]:
    """The stored tensors of every linear the config quantizes, by `method` (gptq, act-rtn), by module
    name; `riders` go through each float layer on the way (source_pass)."""
    ids = calibration_ids(Tokenizer(src.path), calib, nsamples, seqlen, src.config.hidden_size)  # (n, seqlen)
    calib_windows = embedded(src, ids, batch=BATCH)
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

    def calibrate(i: int, layer) -> None:  # Hessians of the float layer's inputs; quantize; run the quantized one
        linears = {n: m for n, m in layer.named_modules() if isinstance(m, Linear)}
        hessians = {n: Hessian(m.in_features) for n, m in linears.items()}
        hooks = [m.register_forward_hook(lambda m, inp, _, n=n: hessians[n].add(inp[0]))
                 for n, m in linears.items()]
        sparse = {n: (m, []) for n, m in layer.named_modules() if isinstance(m, SparseMLP)}  # and their inputs
        hooks += [m.register_forward_pre_hook(lambda m, inp, seen=seen: seen.append(inp[0].reshape(-1, inp[0].shape[-1])))
                  for m, seen in sparse.values()]
        for b in range(0, nsamples, BATCH):
            layer(calib_windows.x[b:b + BATCH], calib_windows.step)
        for n, (mlp, seen) in sparse.items():
            few_tokens_experts(n, mlp, torch.cat(seen), hessians)
        for h in hooks:
            h.remove()
        for n, m in linears.items():
            quantize_linear(f"model.layers.{i}.{n}", m, hessians.pop(n).matrix())
        calib_windows.through(layer)  # the quantized layer's outputs: the next layer's inputs

    source_pass(src, list(riders), after=calibrate, progress=progress, desc=method)
    cfg = src.config
    x, calib_windows.x = final_norm(src)(calib_windows.x), None
    head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    head.weight = torch.nn.Parameter(head_weight(src).float(), requires_grad=False)
    hessian = hessian_of(x)
    del x
    quantize_linear("lm_head", head, hessian, update=False)
    return out


def few_tokens_experts(name: str, mlp: SparseMLP, x: torch.Tensor, hessians: dict) -> None:
    """The rule for experts the router sent few calibration tokens: one routed fewer than FEW_TOKENS (of the
    sparse MLP `name`'s inputs x (tokens, hidden)) is calibrated as though all of them had been routed to
    it (its gate/up on x, its down_proj on its own intermediate of x): a Hessian of a handful of tokens,
    or none, says little about the inputs the expert will see. The linears' hooks add what runs here."""
    for e, expert in enumerate(mlp.experts):
        prefix = f"{name}.experts.{e}."
        if hessians[prefix + "gate_up_proj"].tokens < FEW_TOKENS:
            for part in ("gate_up_proj", "down_proj"):
                hessians[prefix + part] = Hessian(hessians[prefix + part].h.shape[0])
            for b in range(0, x.shape[0], FEW_TOKENS_BATCH):
                expert(x[b:b + FEW_TOKENS_BATCH])


def calibration_params(calib: str, nsamples: int, seqlen: int, act_order: bool, damp: float) -> dict:
    """The calibrated methods' settings as a checkpoint records them (quantization_config)."""
    return {"act_order": act_order, "damp": damp, "nsamples": nsamples, "seqlen": seqlen, "calibration": calib}


def calibrated_convert(src, out=None, qconfig: QuantConfig | None = None, *, method: str = "gptq",
                       calib: str = "builtin", nsamples: int = 128, seqlen: int = 512, act_order: bool = False,
                       damp: float = DAMP, force: bool = False, max_shard_bytes: int = 2 << 30, progress: bool = True,
                       report: bool = True, ref=None, **options) -> Summary:
    """Quantize a checkpoint dir with GPTQ or act-rtn (`method`; formats from `qconfig` or
    QuantConfig.from_options(**options), as for convert); returns the converter's Summary. ref: the
    report's reference (quantize/report.py), finished, if a pass over the source already made it; else
    it rides the calibration's pass."""
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
        own_ref = ref is None and report and can_measure(plan.src)
        ref = reference(plan.src) if own_ref else ref
        weights = calibrated_weights(plan.src, qconfig, method, calib, nsamples, seqlen, act_order, damp, progress,
                                     (ref.windows,) if own_ref else ())
        written = write_quantized(plan, out, lambda job: weights.pop(job.module) if job.module in weights
                                  else job.fmt.quantize(plan.src.read(job.source)),  # embeddings: round to nearest
                                  force, max_shard_bytes, progress, report, ref)
    return plan.summary(out, time.perf_counter() - t0, mem.peak, written)
