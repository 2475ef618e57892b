"""Sampling: logits processing (repetition penalty, temperature, top-k, top-p, min-p, in HF transformers'
order), left-padded batches, and text that ends before stop strings. The decode loop that uses them
is decode.py's."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .errors import QliteError

NON_FINITE = "the model's logits are NaN or infinite: its weights or activations overflowed (try --dtype float32)"
INITIAL_NEW_TOKENS = 256  # the KV cache's first size past the prompt; it doubles as needed


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy, as in llama.cpp
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0
    max_new_tokens: int = 512
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self):
        checks = [
            (math.isfinite(self.temperature) and self.temperature >= 0, "temperature", "must be >= 0"),
            (self.top_k >= 0, "top_k", "must be >= 0"),
            (0 < self.top_p <= 1, "top_p", "must be in (0, 1]"),
            (0 <= self.min_p < 1, "min_p", "must be in [0, 1)"),
            (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
             "must be > 0"),
            (self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1"),
        ]
        for ok, name, why in checks:
            if not ok:  # the CLI checks its flags first; this is a file's value (generation_config.json)
                raise QliteError(f"{name} {why}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """logits (B, V); seen (B, V) bool, tokens already in the sequence: divide positive logits by
    the penalty, multiply negative ones (CTRL, Keskar et al. 2019)."""
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalized, logits)


def filter_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def filter_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probabilities sum to at least p (of equal
    ones, the earlier in the row first)."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True, dim=-1, stable=True)
    cum = sorted_logits.softmax(-1).cumsum(-1)
    drop_sorted = cum - sorted_logits.softmax(-1) >= p  # mass before this token already reaches p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def filter_min_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep tokens at least p times as likely as the most likely one (Nguyen et al. 2024, min-p)."""
    if p <= 0:
        return logits
    floor = logits.max(-1, keepdim=True).values + math.log(p)  # p * max prob, in logit space
    return logits.masked_fill(logits < floor, float("-inf"))


def top_k_candidates(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits filter_top_k keeps, as (values, ids) (B, n) in vocabulary order, n >= k: the k
    largest and any equal to the k-th (values below a row's k-th are -inf). Filtering these instead
    of the whole vocabulary gives the same distribution (ties in the same order) without the top-p
    filter's sort over all 152k logits each token."""
    values, ids = torch.topk(logits, k + 1, dim=-1)  # sorted, largest first; one more to see ties
    kth = values[..., k - 1:k]
    if bool((values[..., k:] == kth).any()):  # ties at the k-th are kept too: take them all
        values, ids = torch.topk(logits, int((logits >= kth).sum(-1).max()), dim=-1)
    else:
        values, ids = values[..., :k], ids[..., :k]
    ids, order = ids.sort(-1)
    values = values.gather(-1, order)
    return values.masked_fill(values < kth, float("-inf")), ids


TOP_P_CANDIDATES = 1024  # top-p without top-k looks among this many first


def top_p_candidates(logits: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """What filter_top_p keeps, as (values, ids) (B, n) (the rest of the n are -inf), found among the
    TOP_P_CANDIDATES largest logits with probabilities over the whole row, in filter_top_p's order
    (by value, ties by position); None when the kept set could reach past them (then the whole
    vocabulary is sorted)."""
    values, ids = torch.topk(logits, min(TOP_P_CANDIDATES, logits.shape[-1]), dim=-1)
    ids, order = ids.sort(-1)
    values, order = values.gather(-1, order).sort(dim=-1, descending=True, stable=True)  # (B, n)
    ids = ids.gather(-1, order)
    probs = (values - torch.logsumexp(logits, -1, keepdim=True)).exp()
    drop = probs.cumsum(-1) - probs >= p  # as filter_top_p: the mass before already reaches p
    smallest_kept = values.masked_fill(drop, float("inf")).amin(-1)  # (B,)
    if not bool((smallest_kept > values[..., -1]).all()):  # a kept value ties or reaches the cut
        return None
    return values.masked_fill(drop, float("-inf")), ids


def next_token(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None,
               generator: torch.Generator | None) -> torch.Tensor:
    """logits (B, V) float32 -> token ids (B,)."""
    if params.repetition_penalty != 1.0 and seen is not None:
        logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    if params.greedy:
        return logits.argmax(-1)
    # shifted so the largest is 0 first: a tiny temperature (1e-300) then sends the rest to -inf, as its
    # limit (greedy) does, instead of overflowing every logit to inf
    temperature = max(params.temperature, torch.finfo(logits.dtype).tiny)  # not 0 in the logits' dtype
    logits, ids = (logits - logits.amax(-1, keepdim=True)) / temperature, None
    if 0 < params.top_k < logits.shape[-1]:
        logits, ids = top_k_candidates(logits, params.top_k)  # (B, n): the rest has probability 0
        logits = filter_top_p(logits, params.top_p)
    elif params.top_p < 1 and (found := top_p_candidates(logits, params.top_p)) is not None:
        logits, ids = found
    else:
        logits = filter_top_p(logits, params.top_p)
    logits = filter_min_p(logits, params.min_p)
    probs = logits.softmax(-1)
    if not bool(torch.isfinite(probs).all()):
        raise QliteError(NON_FINITE)
    choice = torch.multinomial(probs, 1, generator=generator)  # (B, 1)
    return (choice if ids is None else ids.gather(-1, choice))[:, 0]


def left_padded(prompts: list[list[int]], capacity: int, pad_id: int = 0, device="cpu"):
    """Prompts as one batch, padded on the left to the longest (L): ids (B, L), key_mask (B, capacity)
    True at real tokens, positions (B, L) counting each row's real tokens from 0."""
    B, L = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    key_mask = torch.zeros((B, capacity), dtype=torch.bool)
    for row, p in enumerate(prompts):
        ids[row, L - len(p):] = torch.tensor(p)
        key_mask[row, L - len(p):L] = True
    positions = (key_mask[:, :L].long().cumsum(-1) - 1).clamp(min=0)
    return ids.to(device), key_mask.to(device), positions.to(device)


class StopText:
    """Text of tokens pushed one at a time, ending before the first stop string: text that could be
    the start of a stop string is held back until it is known not to be."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        from .tokenizer import StreamDecoder

        self.decoder, self.stop = StreamDecoder(tokenizer), stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.pending = ""
        self.stopped = False

    def _cut(self) -> int:
        return min((i for i in (self.pending.find(s) for s in self.stop) if i >= 0), default=-1)

    def push(self, token: int) -> str:
        """The text that is now certain; after a stop string, `stopped` is set and nothing follows."""
        self.pending += self.decoder.push(token)
        cut = self._cut()
        if cut >= 0:
            self.stopped = True
            text, self.pending = self.pending[:cut], ""
            return text
        if len(self.pending) > self.hold:
            text = self.pending[:len(self.pending) - self.hold]
            self.pending = self.pending[len(self.pending) - self.hold:]
            return text
        return ""

    def flush(self) -> str:
        """What is held back, at the end of generation (cut at a stop string)."""
        if self.stopped:
            return ""
        self.pending += self.decoder.flush()
        cut = self._cut()
        text, self.pending = (self.pending if cut < 0 else self.pending[:cut]), ""
        return text
