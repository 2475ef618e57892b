"""The functional benchmark: greedy answers of a baseline and of models to a task suite (default: the
~300 tasks of task_sources.py), scored in the sandbox, compared in pairs, by KLD on the baseline's own
answers and by `qlite eval`'s KLD on the built-in texts, beside each model's size. A model is a
checkpoint dir, or a .gguf file that answers through llama.cpp (the bench extra) with the baseline's
prompt ids. Each model's answers are kept in the results file as it finishes, so a run that stops
resumes, and a later run with more models answers only the new ones (the baseline's answers are made
once). A model is known by its path and the tasks, tokens and dtype it was asked with.

    python -m eval.benchmarks.functional --baseline DEMO --out results.json MODEL_DIR_OR_GGUF... [--markdown table.md]
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import click

from qlite.outputs import write_file_atomic

from ..code_eval import CodeRow, TaskResult, answer_tasks, compare_rows
from ..task_sources import tasks_named

TEXTS = ("code", "prose")


def key(model_dir: Path, tasks, max_new_tokens: int, dtype: str) -> str:
    tasks_hash = hashlib.sha256(json.dumps([t.name + t.prompt + t.tests for t in tasks]).encode()).hexdigest()[:16]
    return f"{Path(model_dir).resolve()}|{tasks_hash}|{max_new_tokens}|{dtype}"


def run(baseline: Path, model_dirs: list[Path], tasks_source: str, out: Path, max_new_tokens: int = 512,
        dtype: str = "auto", fidelity_tasks: int = 64, max_tasks: int | None = None,
        text_chunks: int = 8) -> list[CodeRow]:
    """The rows, baseline first; each model row's `text` holds its size and its KLD on the built-in
    texts (text_chunks chunks of 512 tokens each; 0: none)."""
    tasks = tasks_named(tasks_source)[:max_tasks]
    store = json.loads(out.read_text()) if out.is_file() else {}
    answered = store.setdefault("answered", {})  # key -> {"row": CodeRow summary, "sequences": [[prompt, answer]]}
    kept = store.setdefault("answer_fidelity", {})  # "baseline key|model key|tasks read" -> Fidelity summary
    on_text = store.setdefault("text", {})  # "baseline path|model path|chunks" -> size and KLD per text
    dirs = [Path(baseline), *map(Path, model_dirs)]
    keys = [key(d, tasks, max_new_tokens, dtype) for d in dirs]
    rows = []
    for d, k in zip(dirs, keys):
        if k not in answered:
            row, sequences = answer_tasks(d, tasks, dtype, max_new_tokens, prompter=dirs[0])
            answered[k] = {"row": {"model": row.model, "seconds": row.seconds,
                                   "results": [vars(r) for r in row.results]}, "sequences": sequences}
            write_file_atomic(out, json.dumps(store), "--out")
        saved = answered[k]["row"]
        rows.append(CodeRow(saved["model"], [TaskResult(**r) for r in saved["results"]], saved["seconds"]))
    fidelity_keys = [f"{keys[0]}|{k}|{fidelity_tasks}" for k in keys[1:]]
    for row, fk in zip(rows[1:], fidelity_keys):
        row.answer_fidelity = kept.get(fk, {})
    compare_rows(rows, dirs, answered[keys[0]]["sequences"], dtype, fidelity_tasks)
    kept.update({fk: row.answer_fidelity for row, fk in zip(rows[1:], fidelity_keys)})
    text_keys = {d: f"{dirs[0].resolve()}|{d.resolve()}|{text_chunks}" for d in dirs[1:]}
    todo = [d for d in dirs[1:] if text_keys[d] not in on_text]
    if text_chunks and todo:
        on_text.update({text_keys[d]: t for d, t in zip(todo, text_fidelity(dirs[0], todo, text_chunks, dtype))})
    for row, d in zip(rows[1:], dirs[1:]):
        row.text = on_text.get(text_keys[d], {})
    store["table"] = [r.summary() for r in rows]
    write_file_atomic(out, json.dumps(store), "--out")
    return rows


def text_fidelity(baseline: Path, model_dirs: list[Path], chunks: int, dtype: str) -> list[dict]:
    """Per model: its format, bits per weight and MiB (eval.run.describe_model) and its KLD against the
    baseline on `chunks` chunks of 512 tokens of each built-in text, as `qlite eval` measures them."""
    from ..run import evaluate

    rows = evaluate(model_dirs, baseline, data=TEXTS, ctx=512, max_chunks=chunks, dtype=dtype)
    by_model = {}
    for r in rows:
        entry = by_model.setdefault(r.model, {"format": r.format, "bits_per_weight": r.bits_per_weight,
                                              "mib": r.size_mib})
        entry[r.data] = {"kld_mean": r.metrics["kld_mean"], "top1": r.metrics["top1"]}
    return [by_model[d.name] for d in model_dirs]


def row_label(row: CodeRow) -> str:
    """A row's name in tables and plots: a GGUF's llama.cpp type (llama.cpp Q4_0), else the model's name."""
    return row.text.get("format", row.model) if row.model.endswith(".gguf") and row.text else row.model


def functional_table(rows: list[CodeRow]) -> str:
    """Pass rate, paired difference and the two KLDs of each model beside its size (the baseline first)."""
    head = ("| model | bits/w | MiB | passed | pass rate | vs baseline: +won / -lost | difference | KLD on the "
            "baseline's answers | top-1 there | code KLD | prose KLD |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        text = r.text
        size = f"{text['bits_per_weight']:.2f} | {text['mib']:.0f}" if text else " | "
        klds = " | ".join(f"{text[t]['kld_mean']:.4f}" if t in text else "" for t in TEXTS)
        lines.append(f"| {row_label(r)} | {size} | {r.compared()} | {klds} |")
    lines += ["", f"{len(rows[0].results)} tasks, greedy chat answers; the code of each answer runs against the "
              "task's hidden tests in a sandbox. ± is one standard error; the difference is paired (the same "
              "tasks). KLD on the baseline's answers: KL(baseline || model) per token, in nats, both reading the "
              "baseline's prompt and greedy answer; code/prose KLD: `qlite eval`'s, on the built-in texts. "
              "bits/w: the decoder linears' (a GGUF's: llama.cpp's nominal rate of its type)."]
    return "\n".join(lines)


@click.command()
@click.argument("model_dirs", nargs=-1, type=click.Path(path_type=Path))
@click.option("--baseline", required=True, type=click.Path(path_type=Path))
@click.option("--tasks", "tasks_source", default="suite", show_default=True)
@click.option("--max-tasks", type=int)
@click.option("--out", required=True, type=click.Path(path_type=Path), help="results JSON (read first: a cache)")
@click.option("--max-new-tokens", default=512, show_default=True)
@click.option("--dtype", default="auto", show_default=True)
@click.option("--fidelity-tasks", default=64, show_default=True, help="tasks whose baseline answers the KLD reads")
@click.option("--text-chunks", default=8, show_default=True, help="512-token chunks of each built-in text for "
              "the text KLD (0: none)")
@click.option("--markdown", "md_path", type=click.Path(path_type=Path), help="also write the table here")
@click.option("--plot", "png", type=click.Path(path_type=Path), help="also draw the frontier with the pass rates (PNG)")
def main(model_dirs, baseline, tasks_source, max_tasks, out, max_new_tokens, dtype, fidelity_tasks, text_chunks,
         md_path, png):
    rows = run(baseline, list(model_dirs), tasks_source, out, max_new_tokens, dtype, fidelity_tasks, max_tasks,
               text_chunks)
    table = functional_table(rows)
    click.echo(table)
    if md_path:
        write_file_atomic(md_path, table + "\n", "--markdown")
    if png:
        plot(rows, png)


def plot(rows: list[CodeRow], png: Path) -> dict:
    """The frontier of the models with their size and text KLD measured, with a pass-rate panel."""
    from .plots import Point, frontier

    points = [Point(row_label(r), r.text["mib"], {t: r.text[t]["kld_mean"] for t in TEXTS},
                    llama_cpp=r.model.endswith(".gguf"), pass_diff=100 * r.paired["diff"])
              for r in rows[1:] if r.text]
    return frontier(points, png, title=f"{len(rows[0].results)} code tasks: {rows[0].model} "
                                       f"passes {100 * rows[0].pass_rate:.1f}%")


if __name__ == "__main__":
    main()
