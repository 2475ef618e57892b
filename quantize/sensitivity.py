"""How much KLD each quantizable unit of a checkpoint would add in each candidate format, alone: what
`qlite quantize --target-bpw` ranks tensors by (quantize/budget.py).

A unit is what takes one format: a decoder layer's fused q/k/v, o_proj, fused gate/up and down_proj
(qlite runs each as one matmul; a mixture of experts has gate/up and down_proj per expert, each seeing
only the tokens routed to it), the embeddings and lm_head.

The estimate, second order in the weights' error. Quantizing a unit changes its outputs by
delta = X (W - Q(W))^T (X: its inputs on calibration windows, from the float source). To first order
the logits change by J delta, and the KLD from the float model's distribution p, summed over a
window's positions, is 1/2 sum_t dl_t^T F_t dl_t with F_t = diag(p_t) - p_t p_t^T, the Fisher
information of p_t. With next tokens y_t sampled from p_t and g = the gradient of sum_t log p_t(y_t)
taken back to the unit's outputs, E_y[(g . delta)^2] is exactly that sum (the cross terms vanish:
E[grad log p_t(y_t)] = 0 and the y_t are independent), so 1/2 (g . delta)^2, averaged over samples and
windows and divided by the window's length, estimates the unit's mean KLD per token without running
the model once per unit and format. lm_head's KLD is computed exactly (its logits are the output).

The source runs in float32 one decoder layer at a time (streamed from its files: quantize/source_pass.py,
the report's reference riding the same pass): forward through every layer keeping each layer's input,
then per sample backward from the top, each layer read again and recomputed from its stored input.
lm_head is read in blocks of vocabulary rows."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qlite.checkpoint import CheckpointDir
from qlite.formats import Format, chunk_rows
from qlite.loader import float_layer
from qlite.decoder.linear import Linear
from qlite.decoder.layers import DecoderLayer
from qlite.decoder.mlp import SparseMLP
from qlite.decoder.names import checkpoint_module, linear_parts
from qlite.qconfig import DECODER_MODULE, EMBEDDINGS, LINEAR_KINDS
from qlite.tokenizer import Tokenizer
from quantize.source_pass import Windows, embedded, final_norm, float_config, head_weight, source_pass

WINDOWS, SEQLEN, SAMPLES = 8, 256, 4  # calibration windows (half code, half prose), tokens each, label samples
VOCAB_BLOCK = 16384  # lm_head rows read, converted and quantized at a time


@dataclass(frozen=True)
class Unit:
    name: str  # the runtime's module name: model.layers.3.self_attn.qkv_proj, lm_head, model.embed_tokens
    modules: tuple[str, ...]  # the checkpoint modules it holds (one format for all)


def units(cfg) -> list[Unit]:
    """Every unit of a config, decoder layers in order (each layer's linears as the decoder builds them
    from a 16-bit checkpoint: fused q/k/v and gate/up, every expert's), then the embeddings and lm_head.
    A mixture of experts' router and shared-expert gate are no unit: they stay 16-bit."""
    cfg = dataclasses.replace(cfg, quantization=None)
    found = []
    for i in range(cfg.num_hidden_layers):
        with torch.device("meta"):
            layer = DecoderLayer(cfg, i)  # shapes only
        for name, module in layer.named_modules():
            parts = tuple(f"model.layers.{i}.{part}" for part, _ in linear_parts(name, module)) if isinstance(module, Linear) else ()
            if parts and all(DECODER_MODULE.fullmatch(p)[1] in LINEAR_KINDS for p in parts):
                found.append(Unit(f"model.layers.{i}.{name}", parts))
    return found + [Unit(EMBEDDINGS, (EMBEDDINGS,)), Unit("lm_head", ("lm_head",))]


def quantization_error(w: torch.Tensor, fmt: Format) -> torch.Tensor:
    """W - Q(W) in float32 for a float weight [N, K] (every format quantizes rows independently)."""
    w = w.float()
    return w - fmt.dequantize(fmt.quantize(w), w.shape[1])


@torch.no_grad()
def output_change(x: torch.Tensor, w: torch.Tensor, fmt: Format) -> torch.Tensor:
    """x @ (W - Q(W)).T for inputs x (..., K) and a weight [N, K], the error made in the quantizer's
    chunks of rows: made whole, its temporaries took 8 GB for a 72B layer's gate_up, and left the caches."""
    rows = chunk_rows(w.shape[1])
    return torch.cat([x @ quantization_error(w[r:r + rows], fmt).T for r in range(0, w.shape[0], rows)],
                     dim=-1)  # (..., N)


@torch.inference_mode(False)
@torch.enable_grad()  # the backward passes, whatever the caller's mode
def sensitivities(src: CheckpointDir, candidates: dict[str, list[Format]], ids: torch.Tensor,
                  samples: int = SAMPLES, seed: int = 0, progress: bool = True, riders: tuple[Windows, ...] = ()
                  ) -> dict[str, list[float]]:
    """unit name -> estimated mean KLD per token that quantizing that unit alone in each of its
    candidate formats adds (same order as candidates[unit]); ids: (windows, seqlen) calibration tokens;
    `riders` go through each float layer in the forward pass (source_pass)."""
    from tqdm import tqdm

    cfg = float_config(src)
    windows, seqlen = ids.shape
    generator = torch.Generator().manual_seed(seed)
    forward = embedded(src, ids, keep_inputs=True)  # each layer's input kept, (windows, seqlen, hidden)
    with torch.no_grad():
        source_pass(src, [forward, *riders], progress=progress, desc="sensitivity: forward")
    inputs, step = forward.inputs, forward.step
    last = forward.x.requires_grad_()
    del forward
    normed = final_norm(src)(last)  # (windows, seqlen, hidden)
    # the head and the table are read where used, each let go after: mapped, 0.6 GB of pages each at 30B-A3B
    head_klds, grads = head_pass(normed.detach().flatten(0, 1), head_weight(src), candidates.get("lm_head", []),
                                 samples, generator)
    out = {"lm_head": head_klds}
    # each sample's gradient at the last layer's output: (windows, seqlen, hidden)
    grads = [torch.autograd.grad(normed, last, g.view_as(normed), retain_graph=True)[0] for g in grads]
    del last, normed

    def cost(scores: torch.Tensor) -> float:  # scores (samples, windows) of g . delta -> mean KLD per token
        return float(0.5 * scores.double().pow(2).mean() / seqlen)

    for i in tqdm(reversed(range(cfg.num_hidden_layers)), total=cfg.num_hidden_layers, desc="sensitivity: backward",
                  unit="layer", disable=not progress):
        layer = float_layer(src, cfg, i, experts_as_stored=True).requires_grad_(False)
        x = inputs.pop()
        deltas, scores, hooks = {}, {}, []
        windows_of = {}  # an expert's units: the window of each token routed to it (its outputs are (tokens, out))
        for name, mlp in layer.named_modules():
            if isinstance(mlp, SparseMLP):
                hooks.append(mlp.register_forward_pre_hook(
                    lambda mlp, args, prefix=f"model.layers.{i}.{name}.": keep_routes(mlp, args[0], prefix, windows_of, seqlen)))
        for name, linear in layer.named_modules():
            unit = f"model.layers.{i}.{checkpoint_module(name)}" if isinstance(linear, Linear) else None
            if unit not in candidates:
                continue
            fmts = candidates[unit]
            scores[unit] = torch.zeros(len(fmts), samples, windows)

            def keep_deltas(module, args, output, unit=unit, fmts=fmts):
                if unit not in deltas:  # the first sample: each format's output change, (windows, seqlen, out),
                    # outside the graph (an x @ error product in it would keep each format's error for backward)
                    deltas[unit] = [output_change(args[0], module.weight, f) for f in fmts]
                output.register_hook(lambda g, unit=unit: add_scores(unit, g))

            hooks.append(linear.register_forward_hook(keep_deltas))

        def add_scores(unit, g):  # g: (windows, seqlen, out) for the current sample; an expert's (tokens, out)
            for j, d in enumerate(deltas[unit]):
                per = (g * d).sum(-1)
                scores[unit][j, s] = (per.sum(1) if per.dim() == 2 else
                                      torch.zeros(windows).index_add_(0, windows_of[unit], per))

        for s in range(samples):
            x_in = x.detach().requires_grad_()
            y = layer(x_in, step)
            grads[s] = torch.autograd.grad(y, x_in, grads[s])[0]
        for h in hooks:
            h.remove()
        del layer, deltas  # before the next layer is read
        out.update({unit: [cost(sc[j]) for j in range(sc.shape[0])] for unit, sc in scores.items()})

    if EMBEDDINGS in candidates:  # the looked-up rows' change, against the gradient at the first layer's input
        rows, where = torch.unique(ids, return_inverse=True)
        table = src.read(f"{EMBEDDINGS}.weight")
        g0 = torch.stack(grads)  # (samples, windows, seqlen, hidden)
        out[EMBEDDINGS] = []
        for fmt in candidates[EMBEDDINGS]:
            delta = F.embedding(where, -quantization_error(table[rows], fmt))  # (windows, seqlen, hidden)
            out[EMBEDDINGS].append(cost((g0 * delta).sum((2, 3))))
    return out


@torch.no_grad()
def keep_routes(mlp: SparseMLP, x: torch.Tensor, prefix: str, windows_of: dict, seqlen: int) -> None:
    """For a sparse MLP's input x (windows, seqlen, hidden): each expert's units -> the windows of its tokens."""
    flat = x.reshape(-1, x.shape[-1])  # (tokens, hidden)
    chosen, _ = mlp.route(flat)
    routed = [(f"experts.{expert}", tokens) for expert, tokens, _ in mlp.groups(chosen)]
    for module, tokens in routed + [("shared_expert", torch.arange(flat.shape[0]))]:
        for unit in ("gate_up_proj", "down_proj"):
            windows_of[f"{prefix}{module}.{unit}"] = tokens // seqlen


@torch.no_grad()
def head_pass(x: torch.Tensor, head: torch.Tensor, fmts: list[Format], samples: int, generator: torch.Generator
              ) -> tuple[list[float], list[torch.Tensor]]:
    """For the normed last hidden states x (tokens, hidden) and the float head (vocab, hidden), block by
    block of vocabulary rows: the mean KLD of each format's head against the float one (exact), and for
    `samples` label sets y ~ softmax(logits) the gradient of sum log p(y) at x: head[y] - p @ head."""
    blocks = range(0, head.shape[0], VOCAB_BLOCK)
    lse = torch.full((x.shape[0],), -torch.inf)
    for v in blocks:
        lse = torch.logaddexp(lse, torch.logsumexp(x @ head[v:v + VOCAB_BLOCK].float().T, dim=-1))
    expected = torch.zeros_like(x)  # p @ head, (tokens, hidden)
    best = torch.full((samples, x.shape[0]), -torch.inf)  # Gumbel-max sampling, block by block
    label = torch.zeros((samples, x.shape[0]), dtype=torch.long)
    cross = torch.zeros(len(fmts), x.shape[0])  # sum_v p (l - l_q)
    lse_q = torch.full((len(fmts), x.shape[0]), -torch.inf)
    for v in blocks:
        w = head[v:v + VOCAB_BLOCK].float()  # (block, hidden)
        logits = x @ w.T  # (tokens, block)
        p = torch.exp(logits - lse[:, None])
        expected += p @ w
        for s in range(samples):
            u = torch.rand(logits.shape, generator=generator).clamp_(min=1e-20)
            score, index = (logits - torch.log(-torch.log(u))).max(dim=-1)
            better = score > best[s]
            best[s] = torch.where(better, score, best[s])
            label[s] = torch.where(better, index + v, label[s])
        for j, fmt in enumerate(fmts):
            logits_q = x @ (w - quantization_error(w, fmt)).T
            cross[j] += (p * (logits - logits_q)).sum(-1)
            lse_q[j] = torch.logaddexp(lse_q[j], torch.logsumexp(logits_q, dim=-1))
    klds = (cross - lse[None] + lse_q).clamp(min=0).mean(-1)
    return klds.tolist(), [head[label[s]].float() - expected for s in range(samples)]


def calibration_windows(src: CheckpointDir, windows: int = WINDOWS, seqlen: int = SEQLEN, data: str = "builtin"
                        ) -> torch.Tensor:
    """(windows, seqlen) ids of calibration text as GPTQ reads it: built-in (half code, half prose) or chat."""
    from .calibrate import calibration_ids

    return calibration_ids(Tokenizer(src.path), data, windows, min(seqlen, src.config.max_position_embeddings),
                           src.config.hidden_size)
