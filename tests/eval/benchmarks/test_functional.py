"""The functional benchmark keeps each model's answers in its results file: a second run with one more
model answers only that one, and the table compares them all."""
import json

import pytest

from eval.benchmarks import functional
from eval.code_tasks import TASKS, dump_tasks
from eval.run import evaluate
from quantize.convert import convert
from tiny_models import make_checkpoint


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("functional")
    base = make_checkpoint(root / "base", seed=9, intermediate_size=192, max_position_embeddings=1024)
    int4 = convert(base, root / "int4", bits=4, group_size=32, progress=False).out_dir
    int8 = convert(base, root / "int8", bits=8, progress=False).out_dir
    tasks = root / "tasks.jsonl"
    dump_tasks(TASKS[:2], tasks)
    return base, int4, int8, tasks


def test_answers_are_kept_and_only_new_models_answer(models, tmp_path, monkeypatch):
    base, int4, int8, tasks = models
    out = tmp_path / "results.json"
    answered = []
    real = functional.answer_tasks
    monkeypatch.setattr(functional, "answer_tasks", lambda d, *a, **k: answered.append(d.name) or real(d, *a, **k))
    rows = functional.run(base, [int4], str(tasks), out, max_new_tokens=4, dtype="float32", text_chunks=1)
    assert answered == ["base", "int4"] and [r.model for r in rows] == ["base", "int4"]
    texts = []
    real_text = functional.text_fidelity
    monkeypatch.setattr(functional, "text_fidelity", lambda b, dirs, *a: texts.extend(d.name for d in dirs) or real_text(b, dirs, *a))
    rows = functional.run(base, [int4, int8], str(tasks), out, max_new_tokens=4, dtype="float32", text_chunks=1)
    assert answered == ["base", "int4", "int8"]  # base and int4 came from the file
    assert texts == ["int8"]  # int4's text KLD too
    expected = {(r.model, r.data): r.metrics["kld_mean"] for r in evaluate([int4, int8], base, ctx=512, max_chunks=1, dtype="float32", progress=False)}
    for row in rows[1:]:
        assert {t: row.text[t]["kld_mean"] for t in functional.TEXTS} == {t: expected[row.model, t] for t in functional.TEXTS}
    assert 4 < rows[1].text["bits_per_weight"] < 5 < 8 < rows[2].text["bits_per_weight"] < 9
    table = functional.functional_table(rows)
    assert table.count("\n| int") == 2 and "(baseline)" in table and f"{rows[2].text['mib']:.0f} |" in table
    assert [r.model for r in rows] == ["base", "int4", "int8"] and rows[2].answer_fidelity["tokens"] > 0
    table = json.loads(out.read_text())["table"]
    assert [t["model"] for t in table] == ["base", "int4", "int8"] and table[1]["answer_fidelity"]["kld_mean"] > 0
    read = []
    monkeypatch.setattr(functional, "compare_rows", lambda rows, *a: read.extend(r.model for r in rows[1:] if not r.answer_fidelity))
    functional.run(base, [int4, int8], str(tasks), out, max_new_tokens=4, dtype="float32", text_chunks=1)
    assert read == [] and answered[-1] == "int8"  # the KLDs on the baseline's answers were kept too
    functional.run(base, [int4], str(tasks), out, max_new_tokens=5, dtype="float32", text_chunks=0)  # other settings: asked again
    assert answered[-2:] == ["base", "int4"]
