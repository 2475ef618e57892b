"""The fidelity report every quantized checkpoint carries (quantization_report.json): the recipe
(format per quantizable module), bytes, bits per parameter, and what quantizing cost, measured at
quantize time on the built-in eval text (disjoint from the calibration text): KLD, top-1 agreement
and PPL ratio against the source, as `qlite eval` measures them.

The source runs one float32 decoder layer at a time, streamed from its files (quantize/source_pass.py:
the reference's windows ride whatever pass over the source the quantizing makes anyway: the
sensitivities' forward, GPTQ's calibration; or a pass of their own), so measuring never holds the
16-bit model; the quantized model is loaded whole (it is the small one) and runs as `qlite eval` runs
it (default dtype and kernels)."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from qlite.checkpoint import CheckpointDir
from qlite.fidelity import Fidelity, chunk_tokens, token_stats
from qlite.info import REPORT_NAME
from qlite.loader import load_model
from qlite.native_moe import tiled_experts_within
from qlite.qconfig import EMBEDDINGS
from qlite.texts import load_text
from qlite.tokenizer import Tokenizer
from quantize.source_pass import Windows, embedded, final_norm, head_weight, source_pass

REPORT_VERSION = 1
TEXTS = ("code", "prose")  # eval's built-in texts
CHUNKS, CTX = 2, 512  # per text: 2 x 512 tokens (ctx capped at the model's context)
ROWS = 128  # tokens whose vocabulary-wide float32 statistics are computed together
TILED_EXPERT_BYTES = 256 << 20  # a mixture's experts made for the measurement held at once (beyond one layer's)


def can_measure(src: CheckpointDir) -> bool:
    """Whether SRC has a tokenizer to measure with (a weights-only dir has none: the report then holds
    the recipe and sizes); one that is there but broken is an error now, before any work."""
    if not (src.path / "tokenizer.json").exists():
        return False
    Tokenizer(src.path)
    return True


def recipe(plan) -> dict[str, str]:
    """Every quantizable module (decoder linears, lm_head, embeddings) -> its format, or 16-bit."""
    formats = {}
    for job in plan.jobs:
        module = job.module.removesuffix(".weight")
        if module == "lm_head" or module == EMBEDDINGS or job.source.endswith("_proj.weight"):
            formats[module] = job.fmt.name if job.fmt else "16-bit"
    if plan.qconfig.shares_table(plan.src.config.tie_word_embeddings):
        formats["lm_head"] = f"{formats[EMBEDDINGS]} (the embedding table)"
    return formats


@dataclass
class Reference:
    """The float source on the eval text: built by riding a pass over the source (`windows`), then
    `finish`ed by whoever ran the pass; measure() scores any quantized checkpoint of that source
    against it (--target-kld: every trial against one)."""
    ids: dict[str, torch.Tensor]  # text -> (chunks, ctx) token ids: the chunks `qlite eval --max-chunks` scores
    windows: Windows | None  # every text's chunks together, (texts x chunks, ctx, hidden), through the layers
    seconds: float = 0.0  # the reference's share of the pass it rode
    normed: torch.Tensor | None = None  # the last layer's outputs after the final norm

    def finish(self, src: CheckpointDir) -> "Reference":
        if self.normed is None:
            with torch.inference_mode():
                self.normed = final_norm(src)(self.windows.x)
            self.seconds, self.windows = self.windows.seconds, None
        return self


def reference(src: CheckpointDir, chunks: int = CHUNKS) -> Reference:
    """The report's reference, not yet through the source's layers: give `.windows` to a source_pass."""
    ctx = min(CTX, src.config.max_position_embeddings)
    tokenizer = Tokenizer(src.path)
    ids = {text: torch.tensor(chunk_tokens(leading_tokens(tokenizer, load_text(text), chunks * ctx), ctx, chunks))
           for text in TEXTS}  # (chunks, ctx) each
    return Reference(ids, embedded(src, torch.cat(list(ids.values()))))  # all chunks in one forward per layer


@torch.inference_mode()
def measure(src: CheckpointDir, quantized: Path, chunks: int = CHUNKS, ref: Reference | None = None) -> dict:
    """Fidelity of the checkpoint at `quantized` against `src` on each built-in text; `ref`: the
    reference, through the source's layers (else a pass of its own)."""
    t0, own = time.perf_counter(), ref is None
    if own:
        ref = reference(src, chunks)
        source_pass(src, [ref.windows], progress=False)
    ref.finish(src)
    ids, x = ref.ids, ref.normed  # x: (rows, ctx, hidden)
    chunks, ctx = next(iter(ids.values())).shape
    head = head_weight(src)  # (vocab, hidden), stored dtype

    model = load_model(quantized)
    with tiled_experts_within(TILED_EXPERT_BYTES):  # a mixture's experts: a layer's at a time, not the model's
        texts = scores(model, ids, x, head)
    return {"texts": texts, "chunks": chunks, "ctx": ctx, "seconds": round(time.perf_counter() - t0 + (0 if own else ref.seconds), 1),
            "how": "source in float32, one layer at a time; the checkpoint as `qlite eval` runs it "
                   "(default dtype and kernels); every token after the first of each chunk scored"}


def scores(model, ids: dict, x: torch.Tensor, head: torch.Tensor) -> dict:
    """Each text's statistics: the model's logits on its chunks against the source's (x: the source's normed
    final hidden states, rows of every text's chunks in order)."""
    texts, row = {}, 0
    for text, t in ids.items():
        fidelity = Fidelity()
        ctx = t.shape[1]
        for b in range(t.shape[0]):
            logits = model(t[b:b + 1])[0, :-1]  # (ctx - 1, vocab): one chunk at a time
            for r in range(0, ctx - 1, ROWS):  # the float32 statistics ROWS tokens at a time
                end = min(r + ROWS, ctx - 1)
                base_logp = torch.log_softmax(float32_logits(x[row + b, r:end], head), dim=-1)  # (end - r, vocab)
                fidelity.add(token_stats(base_logp, logits[r:end], t[b, 1 + r:1 + end]))
        row += t.shape[0]
        s = fidelity.summary()
        texts[text] = {k: s[k] for k in ("tokens", "kld_mean", "kld_mean_err", "kld_p99", "top1", "ppl_ratio",
                                         "ppl_ratio_err")}
    return texts


def leading_tokens(tokenizer: Tokenizer, text: str, n: int, spare: int = 64) -> list[int]:
    """The first n tokens of text (all of them if fewer), encoding only a prefix when it holds them
    with `spare` tokens to spare: cutting the text changes only the tokens next to the cut."""
    chars = 8 * (n + spare)
    while chars < len(text):
        ids = tokenizer.encode(text[:chars])
        if len(ids) >= n + spare:
            return ids[:n]
        chars *= 2
    return tokenizer.encode(text)[:n]


def float32_logits(x: torch.Tensor, head: torch.Tensor, block: int = 16384) -> torch.Tensor:
    """x (T, hidden) @ head.T in float32, the head converted block by block of vocabulary rows (a
    float32 copy of a 152k-row head would be twice the stored one)."""
    return torch.cat([x @ head[v:v + block].float().T for v in range(0, head.shape[0], block)], dim=-1)


def write_report(plan, out: Path, fidelity: bool, ref: Reference | None = None) -> dict:
    """quantization_report.json in `out` (the finished output dir, before it is moved into place);
    ref: the reference, if a pass over the source already made it."""
    measurable = fidelity and can_measure(plan.src)
    stored = CheckpointDir(out)
    nbytes = sum(t.nbytes for t in stored.tensors.values())
    params = sum(torch.Size(info.shape).numel() for info in plan.src.tensors.values())
    report = {"report_version": REPORT_VERSION, "source": plan.src.path.name, "quantization": plan.qconfig.describe(),
              "recipe": recipe(plan), "bytes": nbytes, "parameters": params,
              "bits_per_parameter": round(8 * nbytes / params, 4),
              "fidelity": measure(plan.src, out, ref=ref) if measurable else None,
              "not_measured": None if measurable else "SRC has no tokenizer.json" if fidelity else "--no-report"}
    (out / REPORT_NAME).write_text(json.dumps(report, indent=2))
    return report
