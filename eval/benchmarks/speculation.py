"""Speculative decoding against plain decoding, prompt by prompt, in one process: greedy single-stream
decode tokens/s of each (from the first generated token to the last: the prefill is the same for both),
the share of proposals accepted, and whether the output is token for token plain greedy's. Prompt sets:

- code-edit: code_edits.jsonl beside this file (23 snippets, each with an edit to make: rename, type
  hints, docstrings, a bug fix, a refactor; the model is asked for the whole code back);
- open: the built-in code tasks' prompts (code_tasks.jsonl): new code, little to copy;
- prose: chat prose questions.

One speculation serves the whole run, the sets in the order given, as a server or a chat keeps one: prompt
lookup also drafts from the answers of the prompts before (qlite.speculate.Answers).

--speculate DIR drafts with that checkpoint instead of prompt lookup (a draft model with the same tokenizer:
quantized self-speculation is an 8-bit MODEL_DIR with a 4-bit DIR). --baseline DIR also decodes the same
prompts plainly with another checkpoint in the same run (the int4-g128 model, for self-speculation's bar):
its tokens/s and the speculative run's over it.

With --gguf FILE, llama.cpp (llama-cpp-python, same threads) decodes the same prompt tokens greedily in
the same run: its plain decode tokens/s per prompt; with --llama-lookup BIN too, llama.cpp's own
prompt-lookup tool (`llama-lookup`, built from the same vendored source) runs the same prompt text
greedily on that GGUF, up to as many tokens as qlite made: its decode tokens/s and acceptance.

    python -m eval.benchmarks.speculation MODEL_DIR [--sets code-edit,open,prose] [--new-tokens 256] [--speculate DIR]
                                          [--baseline DIR] [--gguf FILE [--llama-lookup BIN]]
"""
from __future__ import annotations

import json
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import click

EDITS_FILE = Path(__file__).with_name("code_edits.jsonl")
PROSE = ["Explain in a few paragraphs why the sky is blue.", "Write a short story about a lighthouse keeper.",
         "What are the trade-offs between renting and buying a home?", "Describe how a bill becomes a law.",
         "Give advice to someone starting to learn the piano as an adult.", "Why do cats purr?",
         "Summarise the causes of the French Revolution.", "How do vaccines train the immune system?"]


def prompt_sets(names: list[str], limit: int | None) -> dict[str, list[str]]:
    from eval.code_tasks import BUILTIN_FILE, load_tasks
    sets = {}
    for name in names:
        if name == "code-edit":
            edits = [json.loads(line) for line in EDITS_FILE.read_text().splitlines() if line.strip()]
            sets[name] = [f"{e['instruction']} Reply with the whole code, changed, and nothing else.\n\n"
                          f"```python\n{e['code']}```" for e in edits]
        elif name == "open":
            sets[name] = [f"Complete this Python function.\n\n```python\n{t.prompt}\n```" for t in load_tasks(BUILTIN_FILE)]
        elif name == "prose":
            sets[name] = list(PROSE)
        else:
            raise click.ClickException(f"--sets: unknown {name} (code-edit, open, prose)")
        sets[name] = sets[name][:limit]
    return sets


def timed_decode(steps) -> tuple[list[int], float]:
    """Drain (token, events) steps: the tokens, and decode tokens/s after the first token."""
    tokens, t_first = [], None
    for token, _ in steps:
        tokens.append(token)
        if t_first is None:
            t_first = time.perf_counter()
    seconds = time.perf_counter() - t_first
    return tokens, (len(tokens) - 1) / seconds if len(tokens) > 1 and seconds > 0 else 0.0


def plain_decode(lm, ids: list[int], new_tokens: int) -> tuple[list[int], float]:
    from qlite.decode import Sequence, decode_batch
    from qlite.generate import SamplingParams

    seq = Sequence(ids, SamplingParams(max_new_tokens=new_tokens), lm.eos_ids, vocab_size=lm.model.config.vocab_size)
    return timed_decode((t, e) for [(t, e)] in decode_batch(lm.model, [ids], [seq]))


def qlite_pair(lm, ids: list[int], new_tokens: int, speculation) -> dict:
    from qlite.decode import Sequence
    from qlite.generate import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens)
    plain, plain_tps = plain_decode(lm, ids, new_tokens)
    before = (speculation.stats.proposed, speculation.stats.accepted, speculation.stats.passes)
    seq = Sequence(ids, params, lm.eos_ids, vocab_size=lm.model.config.vocab_size)
    fast, fast_tps = timed_decode(speculation.decode(lm.model, ids, seq))
    proposed, accepted, passes = (now - then for now, then in zip(
        (speculation.stats.proposed, speculation.stats.accepted, speculation.stats.passes), before))
    return {"tokens": len(plain), "plain_tps": plain_tps, "spec_tps": fast_tps, "identical": fast == plain,
            "proposed": proposed, "accepted": accepted, "per_pass": len(fast) / max(passes, 1)}


def llama_cpp_tps(llm, ids: list[int], new_tokens: int) -> float:
    llm.reset()
    tokens, t_first = 0, None
    for _ in llm.generate(ids, temp=0.0, top_k=1, reset=True):
        tokens += 1
        if t_first is None:
            t_first = time.perf_counter()
        if tokens >= new_tokens:
            break
    return (tokens - 1) / (time.perf_counter() - t_first)


def llama_lookup(binary: Path, gguf: Path, text: str, new_tokens: int, draft: int, threads: int) -> tuple[float, float]:
    """llama.cpp's llama-lookup, greedy, on the prompt text: (decode tokens/s, share of drafts accepted)."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        f.write(text)
        f.flush()
        run = subprocess.run([str(binary), "-m", str(gguf), "-f", f.name, "-n", str(new_tokens), "--temp", "0",
                              "--spec-draft-n-max", str(draft), "-t", str(threads), "-c", "4096"],
                             capture_output=True, text=True, timeout=600)
    log = run.stdout + run.stderr
    found = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", log)
    if run.returncode or not found:
        raise click.ClickException(f"{binary}: {(log.strip().splitlines() or ['failed'])[-1]}")
    accept = re.search(r"accept\s+=\s+([\d.]+)%", log)
    return int(found[1]) / float(found[2]), float(accept[1]) / 100 if accept else 0.0


def med(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})" if values else "-"


@click.command()
@click.argument("model_dir", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option("--sets", default="code-edit,open,prose", show_default=True)
@click.option("--new-tokens", default=256, show_default=True)
@click.option("--draft-tokens", default=7, show_default=True)
@click.option("--threads", default=2, show_default=True)
@click.option("--limit", type=int, help="at most this many prompts per set")
@click.option("--speculate", "drafter", default="lookup", show_default=True, metavar="lookup|DIR",
              help="the drafter: prompt lookup, or a draft model's checkpoint dir")
@click.option("--baseline", type=click.Path(path_type=Path, exists=True, file_okay=False),
              help="also decode plainly with this checkpoint: its tokens/s, and the speculative run's over it")
@click.option("--gguf", type=click.Path(path_type=Path, exists=True, dir_okay=False),
              help="llama.cpp's plain decode of this GGUF on the same prompts, in the same run")
@click.option("--llama-lookup", "lookup_bin", type=click.Path(path_type=Path, exists=True, dir_okay=False),
              help="llama.cpp's llama-lookup binary: its prompt lookup on --gguf, the same prompts")
@click.option("--markdown", "md_path", type=click.Path(path_type=Path), help="also write the table here")
def main(model_dir, sets, new_tokens, draft_tokens, threads, limit, drafter, baseline, gguf, lookup_bin, md_path):
    import torch

    from qlite.pipeline import load
    from qlite.speculate import Speculation

    torch.set_num_threads(threads)
    lm = load(model_dir)
    speculation = Speculation.named(drafter, lm.model, draft_tokens, lm.tokenizer)
    base = load(baseline) if baseline else None
    kind = "lookup" if drafter == "lookup" else "draft"
    if base is not None and base.tokenizer.tok.get_vocab() != lm.tokenizer.tok.get_vocab():
        raise click.ClickException(f"--baseline {baseline}: another tokenizer than {model_dir}'s")
    if lookup_bin and not gguf:
        raise click.ClickException("--llama-lookup runs on --gguf FILE: give both")
    llm = None
    if gguf:
        from llama_cpp import Llama
        llm = Llama(str(gguf), n_ctx=4096, n_threads=threads, n_threads_batch=threads, verbose=False)
    lines = [f"| set | prompts | tokens | qlite plain tok/s | qlite {kind} tok/s | {kind} / plain | accepted | "
             f"tokens per forward | identical to plain greedy |"
             + (f" {baseline.name if baseline else ''} plain tok/s | qlite {kind} / it |" if base else "")
             + (f" llama.cpp plain tok/s | qlite {kind} / llama.cpp |" if llm else "")
             + (f" llama-lookup tok/s | its accepted | qlite {kind} / llama-lookup |" if lookup_bin else ""),
             "|---|---|---|---|---|---|---|---|---|" + ("---|---|" if base else "") + ("---|---|" if llm else "")
             + ("---|---|---|" if lookup_bin else "")]
    for name, prompts in prompt_sets(sets.split(","), limit).items():
        rows = []
        for i, prompt in enumerate(prompts):
            ids = lm.prompt_ids([{"role": "user", "content": prompt}])
            row = qlite_pair(lm, ids, new_tokens, speculation)
            if base:
                row["base_tps"] = plain_decode(base, ids, row["tokens"])[1]
            if llm:
                row["llama_tps"] = llama_cpp_tps(llm, ids, row["tokens"])
            if lookup_bin:
                row["lookup_tps"], row["lookup_accept"] = llama_lookup(lookup_bin, gguf, lm.tokenizer.decode(ids),
                                                                       row["tokens"], draft_tokens, threads)
            rows.append(row)
            click.echo(f"{name} {i}: {json.dumps(row)}", err=True)
        ratio = [r["spec_tps"] / r["plain_tps"] for r in rows]
        accepted = sum(r["accepted"] for r in rows) / max(sum(r["proposed"] for r in rows), 1)
        line = (f"| {name} | {len(rows)} | {sum(r['tokens'] for r in rows)} | {med([r['plain_tps'] for r in rows])} | "
                f"{med([r['spec_tps'] for r in rows])} | {med(ratio)} | {accepted:.0%} | "
                f"{med([r['per_pass'] for r in rows])} | {sum(r['identical'] for r in rows)}/{len(rows)} |")
        if base:
            line += f" {med([r['base_tps'] for r in rows])} | {med([r['spec_tps'] / r['base_tps'] for r in rows])} |"
        if llm:
            line += (f" {med([r['llama_tps'] for r in rows])} | "
                     f"{med([r['spec_tps'] / r['llama_tps'] for r in rows])} |")
        if lookup_bin:
            line += (f" {med([r['lookup_tps'] for r in rows])} | {med([r['lookup_accept'] for r in rows])} | "
                     f"{med([r['spec_tps'] / r['lookup_tps'] for r in rows])} |")
        lines.append(line)
    text = "\n".join(lines)
    click.echo(text)
    if md_path:
        md_path.write_text(text + "\n")


if __name__ == "__main__":
    main()
