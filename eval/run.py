"""Models against a baseline on the same tokens, chunk by chunk: the baseline's log-probabilities for
a chunk are computed once, compared with every model's, then dropped (no logits file; the
vocabulary is 151936 wide). Tables as Markdown and JSON."""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from qlite.checkpoint import CheckpointDir
from qlite.config import load_config
from qlite.errors import QliteError
from qlite.files import read_bytes
from qlite.fidelity import Fidelity, chunk_tokens, token_stats
from qlite.info import decoder_linear_bits_per_weight, format_name
from qlite.loader import load_model
from qlite.outputs import write_file_atomic
from qlite.texts import load_text
from qlite.tokenizer import Tokenizer

from .gguf_peer import GgufPeer, describe_gguf, is_gguf

SCORING = "every token after the first of each chunk is scored"
DECODE_BATCH = 8  # chunks decoded side by side with --decode (each row's numerics are its own)


@dataclass
class Row:
    model: str
    format: str
    bits_per_weight: float
    size_mib: float
    data: str
    metrics: dict


def describe_model(model_dir: Path) -> tuple[str, float, float]:
    """(format, decoder-linear bits per weight, size on disk in MiB)."""
    if is_gguf(model_dir):
        return describe_gguf(model_dir)
    ckpt = CheckpointDir(model_dir)
    size = sum(f.stat().st_size for f in ckpt.files()) / 2**20
    return format_name(ckpt.config), decoder_linear_bits_per_weight(ckpt), size


def _file_hash(path: Path) -> str:
    if not path.exists() and not path.is_symlink():
        return ""
    return hashlib.sha256(read_bytes(path, within=path.parent)).hexdigest()


def decode_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits (B, T, vocab) for ids (B, T) fed one token per step through the KV cache, as generation
    computes them: the decoding kernels' numerics rather than prefill's."""
    cache = model.new_cache(ids.shape[0], ids.shape[1])
    return torch.cat([model(ids[:, t:t + 1], cache) for t in range(ids.shape[1])], dim=1)


@torch.inference_mode()
def evaluate(model_dirs, baseline, data=("code", "prose"), ctx: int = 512, max_chunks: int | None = None,
             dtype: str = "auto", baseline_dtype: str = "float32", progress: bool = True, kernel: str = "auto",
             decode: bool = False) -> list[Row]:
    """decode: the models' logits come one token at a time (decode_logits), the baseline's in one pass.
    A model that is a .gguf file is a llama.cpp peer (eval/gguf_peer.py), scored on the same tokens."""
    from tqdm import tqdm

    baseline = Path(baseline)
    model_dirs = [Path(d) for d in model_dirs]
    tokenizer = Tokenizer(baseline)
    base_cfg = load_config(baseline)
    if ctx > base_cfg.max_position_embeddings:
        raise QliteError(f"--ctx {ctx}: longer than the model's context {base_cfg.max_position_embeddings}")
    base_tokenizer = _file_hash(baseline / "tokenizer.json")
    for d in model_dirs:
        if is_gguf(d):
            if decode:
                raise QliteError(f"--decode: {d} is a GGUF; llama.cpp rows are scored in one pass per chunk")
            continue  # GgufPeer checks its vocabulary and tokenizer
        cfg = load_config(d)
        if cfg.vocab_size != base_cfg.vocab_size or _file_hash(d / "tokenizer.json") != base_tokenizer:
            raise QliteError(f"{d}: its tokenizer differs from the baseline's ({baseline}); "
                             "the models must score the same tokens")
    base = load_model(baseline, dtype=baseline_dtype)
    models = [(d, GgufPeer(d, ctx, tokenizer, base_cfg.vocab_size) if is_gguf(d)
               else load_model(d, dtype=dtype, kernel=kernel)) for d in model_dirs]
    described = {d: describe_model(d) for d in model_dirs}
    rows = []
    for source in data:
        chunks = chunk_tokens(tokenizer.encode(load_text(source)), ctx, max_chunks)
        fidelity = {d: Fidelity() for d in model_dirs}
        batch = DECODE_BATCH if decode else 1
        for i in tqdm(range(0, len(chunks), batch), desc=f"eval {source}", unit="batch" if decode else "chunk",
                      disable=not progress):
            ids = torch.tensor(chunks[i:i + batch])  # (chunks, ctx)
            logits = {d: decode_logits(model, ids) if decode else model(ids) for d, model in models}
            for b in range(ids.shape[0]):
                base_logp = torch.log_softmax(base(ids[b:b + 1])[0, :-1].float(), dim=-1)  # (ctx-1, V)
                for d in model_dirs:
                    fidelity[d].add(token_stats(base_logp, logits[d][b, :-1], ids[b, 1:]))
                del base_logp
        for d in model_dirs:
            rows.append(Row(d.name, *described[d], source, fidelity[d].summary()))
    return rows


def how_run(kernel: str = "auto", decode: bool = False) -> str:
    """How the evaluated models made their logits, for the tables' footnote."""
    return (f"models run with --kernel {kernel}, "
            + ("one token per step through the KV cache (--decode)" if decode else "one pass per chunk"))


def markdown_table(rows: list[Row], baseline: str, ctx: int, how: str = how_run()) -> str:
    head = ("| model | format | bits/w | MiB | data | tokens | PPL | PPL base | PPL ratio | mean KLD "
            "| KLD p50 | p90 | p95 | p99 | p99.9 | top-1 | mean Δp | RMS Δp |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        m = r.metrics
        lines.append(
            f"| {r.model} | {r.format} | {r.bits_per_weight:.2f} | {r.size_mib:.0f} | {r.data} | {m['tokens']} "
            f"| {m['ppl']:.4f} | {m['base_ppl']:.4f} | {m['ppl_ratio']:.4f} ± {m['ppl_ratio_err']:.4f} "
            f"| {m['kld_mean']:.5f} ± {m['kld_mean_err']:.5f} | {m['kld_p50']:.5f} | {m['kld_p90']:.4f} "
            f"| {m['kld_p95']:.4f} | {m['kld_p99']:.4f} | {m['kld_p99.9']:.4f} | {100 * m['top1']:.2f}% "
            f"| {100 * m['dp_mean']:+.3f}% | {100 * m['dp_rms']:.3f}% |")
    lines.append("")
    lines.append(f"Baseline {baseline} (float32 activations, one pass per chunk); {how}. "
                 f"Chunks of {ctx} tokens; {SCORING}. KLD is KL(baseline || model) per token, in nats; "
                 "bits/w counts the decoder's linear layers (scales and zero points included).")
    return "\n".join(lines)


def write_reports(rows: list[Row], baseline: str, ctx: int, json_path: Path | None, md_path: Path | None,
                  code_rows=None, how: str = how_run()) -> str:
    """The Markdown tables (fidelity, then code tasks when run), also written as JSON / Markdown."""
    from .code_eval import code_table

    tables = ([markdown_table(rows, baseline, ctx, how)] if rows else []) + ([code_table(code_rows)] if code_rows else [])
    text = "\n\n".join(tables)
    if json_path:
        report = {"baseline": baseline, "ctx": ctx, "scoring": SCORING, "how": how, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                  "rows": [asdict(r) for r in rows]}
        if code_rows:
            report["code_tasks"] = [r.summary() for r in code_rows]
        write_file_atomic(json_path, json.dumps(report, indent=2))
    if md_path:
        write_file_atomic(md_path, text + "\n")
    return text
