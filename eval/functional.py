"""The functional benchmark: greedy answers of a baseline and of models to a task suite (default: the
~300 tasks of task_sources.py), scored in the sandbox, compared in pairs and by KLD on the baseline's
own answers. Each model's answers are kept in the results file as it finishes, so a run that stops
resumes, and a later run with more models answers only the new ones (the baseline's answers are made
once). A model is known by its dir's path and the tasks, tokens and dtype it was asked with.

    python -m eval.functional --baseline DEMO --out results.json MODEL_DIR...
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import click

from qlite.outputs import write_file_atomic

from .code_eval import CodeRow, TaskResult, answer_tasks, code_table, compare_rows
from .task_sources import tasks_named


def key(model_dir: Path, tasks, max_new_tokens: int, dtype: str) -> str:
    tasks_hash = hashlib.sha256(json.dumps([t.name + t.prompt + t.tests for t in tasks]).encode()).hexdigest()[:16]
    return f"{Path(model_dir).resolve()}|{tasks_hash}|{max_new_tokens}|{dtype}"


def run(baseline: Path, model_dirs: list[Path], tasks_source: str, out: Path, max_new_tokens: int = 512,
        dtype: str = "auto", fidelity_tasks: int = 64, max_tasks: int | None = None) -> list[CodeRow]:
    tasks = tasks_named(tasks_source)[:max_tasks]
    store = json.loads(out.read_text()) if out.is_file() else {}
    answered = store.setdefault("answered", {})  # key -> {"row": CodeRow summary, "sequences": [[prompt, answer]]}
    kept = store.setdefault("answer_fidelity", {})  # "baseline key|model key|tasks read" -> Fidelity summary
    dirs = [Path(baseline), *map(Path, model_dirs)]
    keys = [key(d, tasks, max_new_tokens, dtype) for d in dirs]
    rows = []
    for d, k in zip(dirs, keys):
        if k not in answered:
            row, sequences = answer_tasks(d, tasks, dtype, max_new_tokens)
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
    store["table"] = [r.summary() for r in rows]
    write_file_atomic(out, json.dumps(store), "--out")
    return rows


@click.command()
@click.argument("model_dirs", nargs=-1, type=click.Path(path_type=Path))
@click.option("--baseline", required=True, type=click.Path(path_type=Path))
@click.option("--tasks", "tasks_source", default="suite", show_default=True)
@click.option("--max-tasks", type=int)
@click.option("--out", required=True, type=click.Path(path_type=Path), help="results JSON (read first: a cache)")
@click.option("--max-new-tokens", default=512, show_default=True)
@click.option("--dtype", default="auto", show_default=True)
@click.option("--fidelity-tasks", default=64, show_default=True, help="tasks whose baseline answers the KLD reads")
def main(model_dirs, baseline, tasks_source, max_tasks, out, max_new_tokens, dtype, fidelity_tasks):
    rows = run(baseline, list(model_dirs), tasks_source, out, max_new_tokens, dtype, fidelity_tasks, max_tasks)
    click.echo(code_table(rows))


if __name__ == "__main__":
    main()
