"""Fidelity of a model's next-token distributions to a baseline's, on the same tokens: the statistics
llama.cpp's `perplexity --kl-divergence` reports (perplexity of both, their ratio with its
uncertainty, KL divergence and its percentiles, top-1 agreement, change in the correct token's
probability). Per-token values are collected chunk by chunk, summaries computed at the end.
`qlite eval` and the quantization report (quantize/report.py) both measure with these."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from .errors import QliteError


def chunk_tokens(ids: list[int], ctx: int, max_chunks: int | None = None) -> list[list[int]]:
    """Consecutive, non-overlapping windows of exactly ctx tokens (a short tail is dropped)."""
    if ctx < 2:
        raise QliteError(f"--ctx {ctx}: must be at least 2")
    chunks = [ids[i:i + ctx] for i in range(0, len(ids) - ctx + 1, ctx)]
    if not chunks:
        raise QliteError(f"the text has {len(ids)} tokens, fewer than one --ctx {ctx} chunk")
    return chunks[:max_chunks] if max_chunks else chunks


def token_stats(base_logp: torch.Tensor, model_logits: torch.Tensor, targets: torch.Tensor) -> dict[str, np.ndarray]:
    """Per-position statistics. base_logp: baseline log-probabilities (T, V) float32; model_logits
    (T, V); targets (T,) the tokens that actually come next."""
    logp = torch.log_softmax(model_logits.float(), dim=-1)  # (T, V)
    base_p = base_logp.exp()
    kld = (base_p * (base_logp - logp)).sum(-1).clamp(min=0)  # KL(base || model), (T,)
    lp_t = logp.gather(-1, targets[:, None])[:, 0]
    blp_t = base_logp.gather(-1, targets[:, None])[:, 0]
    return {
        "nll": (-lp_t).double().numpy(),
        "base_nll": (-blp_t).double().numpy(),
        "kld": kld.double().numpy(),
        "same_top": (logp.argmax(-1) == base_logp.argmax(-1)).numpy(),
        "dp": (lp_t.exp() - blp_t.exp()).double().numpy(),
    }


def _mean_err(x: np.ndarray) -> tuple[float, float]:
    """Mean and standard error of the mean."""
    return float(x.mean()), float(x.std(ddof=1) / math.sqrt(len(x))) if len(x) > 1 else 0.0


@dataclass
class Fidelity:
    parts: dict[str, list[np.ndarray]] = field(default_factory=dict)

    def add(self, stats: dict[str, np.ndarray]) -> None:
        for k, v in stats.items():
            self.parts.setdefault(k, []).append(v)

    def summary(self) -> dict[str, float]:
        a = {k: np.concatenate(v) for k, v in self.parts.items()}
        nll, ppl_err = _mean_err(a["nll"])
        base_nll, base_err = _mean_err(a["base_nll"])
        log_ratio, log_ratio_err = _mean_err(a["nll"] - a["base_nll"])  # paired: ln(PPL / PPL_base)
        kld, kld_err = _mean_err(a["kld"])
        top1 = a["same_top"].astype(np.float64)
        dp = a["dp"]
        return {
            "tokens": int(len(a["nll"])),
            "ppl": math.exp(nll), "ppl_err": math.exp(nll) * ppl_err,
            "base_ppl": math.exp(base_nll), "base_ppl_err": math.exp(base_nll) * base_err,
            "ppl_ratio": math.exp(log_ratio), "ppl_ratio_err": math.exp(log_ratio) * log_ratio_err,
            "kld_mean": kld, "kld_mean_err": kld_err,
            **{f"kld_p{p}": float(np.percentile(a["kld"], p)) for p in (99.9, 99, 95, 90, 50)},
            "top1": float(top1.mean()), "top1_err": float(top1.std(ddof=1) / math.sqrt(len(top1))) if len(top1) > 1 else 0.0,
            "dp_mean": float(dp.mean()), "dp_rms": float(np.sqrt((dp ** 2).mean())),
        }


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: 10 log10(|x|^2 / |x - x'|^2)."""
    ref = reference.float()
    noise = (ref - approx.float()).pow(2).sum().clamp(min=1e-30)
    return float(10 * torch.log10(ref.pow(2).sum() / noise))
