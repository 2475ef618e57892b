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
from qlite.kv_quant import KINDS as KV_KINDS
from qlite.loader import check_kv_cache, load_model
from qlite.decoder.causal_lm import CausalLM
from qlite.outputs import write_file_atomic
from qlite.texts import load_text
from qlite.tokenizer import Tokenizer

from .gguf_peer import GgufPeer, describe_gguf, is_gguf

SCORING = "every token after the first of each chunk is scored"
DECODE_BATCH = 8  # chunks decoded side by side with --decode (each row's numerics are its own)
LONG_CTX = 1024  # chunks longer than this, or models with a quantized KV cache, go through the cache in blocks


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


def in_blocks(ctx: int, decode: bool, kv_caches: tuple[str, ...]) -> bool:
    """Whether chunks are scored block by block through the KV caches (score_blocks)."""
    return not decode and (ctx > LONG_CTX or tuple(kv_caches) != ("bf16",))


def block_logits(model, ids: torch.Tensor, block: int):
    """Logits (B, <= block, vocab) for ids (B, T), block after block through a KV cache made now (with
    the model's kv_bits of this moment): long chunks without T x vocab logits at once, and a quantized
    cache read as generation reads it."""
    cache = model.new_cache(ids.shape[0], ids.shape[1])
    return (model(ids[:, a:a + block], cache) for a in range(0, ids.shape[1], block))


def decode_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits (B, T, vocab) for ids (B, T) fed one token per step through the KV cache, as generation
    computes them: the decoding kernels' numerics rather than prefill's."""
    cache = model.new_cache(ids.shape[0], ids.shape[1])
    return torch.cat([model(ids[:, t:t + 1], cache) for t in range(ids.shape[1])], dim=1)


@torch.inference_mode()
def evaluate(model_dirs, baseline, data=("code", "prose"), ctx: int = 512, max_chunks: int | None = None,
             dtype: str = "auto", baseline_dtype: str = "float32", progress: bool = True, kernel: str = "auto",
             decode: bool = False, kv_caches: tuple[str, ...] = ("bf16",)) -> list[Row]:
    """decode: the models' logits come one token at a time (decode_logits), the baseline's in one pass.
    kv_caches: each model is scored with each KV cache kind (a row each, named "model kv int8" where
    more than bf16 is asked). Chunks past LONG_CTX tokens, and any quantized cache, are scored block by
    block through the caches (block_logits; the baseline's in float32). A model that is a .gguf file is a
    llama.cpp peer (eval/gguf_peer.py), scored on the same tokens."""
    from tqdm import tqdm

    baseline = Path(baseline)
    model_dirs = [Path(d) for d in model_dirs]
    tokenizer = Tokenizer(baseline)
    base_cfg = load_config(baseline)
    if ctx > base_cfg.context_length:
        raise QliteError(f"--ctx {ctx}: longer than the model's context {base_cfg.context_length}")
    blocks = in_blocks(ctx, decode, kv_caches)
    base_tokenizer = _file_hash(baseline / "tokenizer.json")
    for d in model_dirs:
        if is_gguf(d):
            if decode:
                raise QliteError(f"--decode: {d} is a GGUF; llama.cpp rows are scored in one pass per chunk")
            if tuple(kv_caches) != ("bf16",):
                raise QliteError(f"--kv-cache: {d} is a GGUF; llama.cpp rows are scored with its own cache")
            continue  # GgufPeer checks its vocabulary and tokenizer
        cfg = load_config(d)
        for kv in kv_caches:
            check_kv_cache(kv, cfg, d)
        if cfg.vocab_size != base_cfg.vocab_size or _file_hash(d / "tokenizer.json") != base_tokenizer:
            raise QliteError(f"{d}: its tokenizer differs from the baseline's ({baseline}); "
                             "the models must score the same tokens")
    base = load_model(baseline, dtype=baseline_dtype)
    loaded = {d: GgufPeer(d, ctx, tokenizer, base_cfg.vocab_size) if is_gguf(d) else load_model(d, dtype=dtype, kernel=kernel)
              for d in model_dirs}
    named = len(kv_caches) > 1 or tuple(kv_caches) != ("bf16",)
    # (row name, dir, model, kv cache bits or None for a GGUF)
    label = row_names(model_dirs)
    variants = [(label[d] + (f" kv {kv}" if named else ""), d, loaded[d], None if is_gguf(d) else KV_KINDS[kv])
                for d in model_dirs for kv in ((None,) if is_gguf(d) else kv_caches)]
    described = {d: describe_model(d) for d in model_dirs}
    rows = []
    for source in data:
        chunks = chunk_tokens(tokenizer.encode(load_text(source)), ctx, max_chunks)
        fidelity = {name: Fidelity() for name, *_ in variants}
        batch = DECODE_BATCH if decode else 1
        for i in tqdm(range(0, len(chunks), batch), desc=f"eval {source}", unit="batch" if decode else "chunk",
                      disable=not progress):
            ids = torch.tensor(chunks[i:i + batch])  # (chunks, ctx)
            if blocks:
                score_blocks(base, variants, ids, fidelity)
                continue
            logits = {}
            for name, _, model, bits in variants:
                if bits is not None:
                    model.kv_bits = bits
                logits[name] = decode_logits(model, ids) if decode else model(ids)
            for b in range(ids.shape[0]):
                base_logp = torch.log_softmax(base(ids[b:b + 1])[0, :-1].float(), dim=-1)  # (ctx-1, V)
                for name in logits:
                    fidelity[name].add(token_stats(base_logp, logits[name][b, :-1], ids[b, 1:]))
                del base_logp
        for name, d, *_ in variants:
            rows.append(Row(name, *described[d], source, fidelity[name].summary()))
    return rows


def row_names(model_dirs: list[Path]) -> dict[Path, str]:
    """Each model's row name: its dir's name, or as many of its last path parts as tell it from another model of
    the same name (rows are scored by name: two models called alike would share one row's numbers)."""
    names = {}
    for d in model_dirs:
        parts = d.resolve().parts
        for n in range(1, len(parts) + 1):
            name = "/".join(parts[-n:])
            if not any(o.resolve() != d.resolve() and "/".join(o.resolve().parts[-n:]) == name for o in model_dirs):
                break
        names[d] = name
    return names


def score_blocks(base, variants, ids: torch.Tensor, fidelity: dict) -> None:
    """One chunk ids (1, ctx) scored block by block: the baseline's and every variant's logits for a
    block of base.prefill_chunk tokens at a time (a GGUF peer's in one pass, then cut), compared and
    dropped before the next."""
    block = base.prefill_chunk
    streams = {}
    for name, _, model, bits in variants:
        if bits is None:
            whole = model(ids)
            streams[name] = (whole[:, a:a + block] for a in range(0, ids.shape[1], block))
        else:
            model.kv_bits = bits
            streams[name] = block_logits(model, ids, block)
    for a, base_logits in zip(range(0, ids.shape[1], block), block_logits(base, ids, block)):
        targets = ids[0, a + 1:a + block + 1]  # the last block's final position has none
        base_logp = torch.log_softmax(base_logits[0, :len(targets)].float(), dim=-1)  # (n, V)
        for name, stream in streams.items():
            fidelity[name].add(token_stats(base_logp, next(stream)[0, :len(targets)], targets))


def how_run(kernel: str = "auto", decode: bool = False, blocks: bool = False) -> str:
    """How the evaluated models made their logits, for the tables' footnote."""
    return (f"models run with --kernel {kernel}, "
            + ("one token per step through the KV cache (--decode; the baseline in one pass per chunk)" if decode else
               f"blocks of {CausalLM.prefill_chunk} tokens through the KV cache (the baseline's too, in a "
               "float32 cache)" if blocks else "one pass per chunk (the baseline's too)"))


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
    lines.append(f"Baseline {baseline} (float32 activations); {how}. "
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
        write_file_atomic(json_path, json.dumps(report, indent=2), "--json")
    if md_path:
        write_file_atomic(md_path, text + "\n", "--markdown")
    return text
