"""The built-in code tasks are sound (each reference passes its tests, a wrong answer fails), and
the sandbox scores hand-written answers as it should."""
import json
import time

import pytest

from eval.code_eval import CodeRow, TaskResult, code_table, extract_code, paired_difference, score
from eval.code_tasks import TASKS, dump_tasks, load_tasks
from eval.sandbox import Limits, run_python
from qlite.errors import QliteError

FAST = Limits(seconds=5)


def test_enough_tasks_across_the_kinds():
    assert len(TASKS) >= 60
    assert len({t.name for t in TASKS}) == len(TASKS)
    assert sum(t.prose for t in TASKS) >= 4
    assert sum(t.prompt.startswith("class ") for t in TASKS) >= 5


@pytest.mark.parametrize("task", TASKS, ids=lambda t: t.name)
def test_reference_passes_and_a_stub_fails(task):
    ok = run_python(task.reference + "\n\n" + task.tests, FAST)
    assert ok.passed, ok.reason + "\n" + ok.output
    if not task.prose:
        stub_only = task.prompt + ("\n    pass" if task.prompt.rstrip().endswith('"""') else "\n        pass")
        assert not run_python(stub_only + "\n\n" + task.tests, FAST).passed


def test_code_is_taken_from_the_block_that_defines_the_entry():
    answer = ("Here you go:\n```python\nimport math\n\ndef area(r):\n    return math.pi * r * r\n```\n"
              "Example:\n```python\nprint(area(2))\n```")
    assert extract_code(answer, "area") == "import math\n\ndef area(r):\n    return math.pi * r * r\n"
    assert extract_code("def area(r):\n    return 1", "area") == "def area(r):\n    return 1"
    assert extract_code("```\nclass Stack:\n    pass\n", "Stack") == "class Stack:\n    pass\n"  # unclosed fence


HANDWRITTEN = {  # answer -> (passed, reason starts with)
    "```python\ndef add(a, b):\n    return a + b\n```": (True, "ok"),
    "```python\ndef add(a, b):\n    return a - b\n```": (False, "failed: AssertionError"),
    "```python\ndef add(a, b):\n    while True:\n        pass\n```": (False, "timeout"),
    "```python\ndef add(a, b):\n    print('x' * 10**6)\n    return a + b\n```": (False, "output too large"),
    "```python\nimport numpy\ndef add(a, b):\n    return a + b\n```": (False, "failed: ModuleNotFoundError"),
    "```python\nimport os\ndef add(a, b):\n    os.system('echo pwned > pwned.txt')\n    return a + b\n```":
        (False, "failed: PermissionError"),
    "```python\ndef add(a, b):\n    return len(bytearray(1 << 40))\n```": (False, "memory"),
    "```python\nimport sys\nsys.exit(0)\n```": (False, "exited before the tests ran"),
    "```python\nimport socket\ndef add(a, b):\n    socket.create_connection(('127.0.0.1', 9))\n```":
        (False, "failed: PermissionError"),
    "I cannot help with that.": (False, "failed: SyntaxError"),
}


def test_the_sandbox_scores_handwritten_answers():
    from eval.code_tasks import Task
    task = Task("add", "add", "def add(a, b):", "assert add(2, 3) == 5\nassert add(-1, 1) == 0")
    t0 = time.monotonic()
    results = score([task] * len(HANDWRITTEN), [(a, 1) for a in HANDWRITTEN], Limits(seconds=3))
    for (answer, (passed, reason)), r in zip(HANDWRITTEN.items(), results):
        assert r.passed == passed and r.reason.startswith(reason), (answer, r)
    assert time.monotonic() - t0 < 60


def test_nothing_escapes_the_sandbox_working_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_python("open('left.txt', 'w').write('x')\nimport os\nos.remove('left.txt')", FAST)
    assert list(tmp_path.iterdir()) == []


def test_paired_difference_and_table():
    names = [f"t{i}" for i in range(10)]
    base = CodeRow("base", [TaskResult(n, i < 6, "", 10) for i, n in enumerate(names)], 1.0)
    model = CodeRow("int4", [TaskResult(n, 1 <= i < 8, "", 10) for i, n in enumerate(names)], 1.0)
    p = paired_difference(model, base)
    assert (p["wins"], p["losses"]) == (2, 1) and p["diff"] == pytest.approx(0.1)
    assert p["diff_err"] == pytest.approx((3 - 1 / 10) ** 0.5 / 10)
    model.paired = p
    table = code_table([base, model])
    assert "| int4 | 10 | 7 | 70.0% ± 14.5 | +2 / -1 | +10.0 ± 17.0 pp |" in table


def test_task_files_round_trip_and_bad_files_are_named(tmp_path):
    path = tmp_path / "tasks.jsonl"
    dump_tasks(TASKS[:3], path)
    assert load_tasks(str(path)) == TASKS[:3]
    (tmp_path / "bad.jsonl").write_text(json.dumps({"name": "x"}) + "\n")
    with pytest.raises(QliteError, match="bad.jsonl:1: entry is missing"):
        load_tasks(str(tmp_path / "bad.jsonl"))
    (tmp_path / "bad.jsonl").write_text(json.dumps({"name": "x", "entry": "x", "prompt": "p", "tests": "t",
                                                    "prose": "false"}) + "\n")
    with pytest.raises(QliteError, match="bad.jsonl:1: prose must be true or false, got 'false'"):
        load_tasks(str(tmp_path / "bad.jsonl"))
    (tmp_path / "bad.jsonl").write_text("[1]\n")
    with pytest.raises(QliteError, match="bad.jsonl:1: not a task"):
        load_tasks(str(tmp_path / "bad.jsonl"))
    with pytest.raises(QliteError, match="--tasks .*missing.jsonl: not found"):
        load_tasks(str(tmp_path / "missing.jsonl"))


def test_answer_fidelity_compares_the_models_on_the_answer_tokens_only(tmp_path):
    import torch

    from eval.code_eval import answer_fidelity
    from qlite.loader import load_model
    from tiny_models import make_checkpoint

    base = load_model(make_checkpoint(tmp_path / "base", seed=3), dtype="float32")
    other = load_model(make_checkpoint(tmp_path / "other", seed=4), dtype="float32")
    sequences = [([1, 2, 3], [4, 5]), ([6, 7], [8, 9, 10]), ([1], [])]  # (prompt, answer); an empty answer adds nothing
    same, fid = answer_fidelity({"base": base, "other": other}, base, sequences).values()
    assert same["tokens"] == 5 and same["kld_mean"] == pytest.approx(0, abs=1e-6) and same["top1"] == 1.0
    kld = []
    for prompt, answer in sequences[:2]:  # by hand: the positions after each prompt token but the answer's last
        ids = torch.tensor([prompt + answer])
        p = torch.log_softmax(base(ids)[0].float(), -1)[len(prompt) - 1:-1]
        q = torch.log_softmax(other(ids)[0].float(), -1)[len(prompt) - 1:-1]
        kld += (p.exp() * (p - q)).sum(-1).tolist()
    assert fid["kld_mean"] == pytest.approx(sum(kld) / len(kld), rel=1e-5)


def test_evenly_spreads_the_chosen_tasks():
    from eval.code_eval import evenly
    assert evenly(10, 4) == [0, 2, 5, 7] and evenly(3, 8) == [0, 1, 2] and evenly(5, 0) == []


def test_an_answer_stops_at_the_models_context(tmp_path):
    """A prompt near the end of a short context gets the tokens that are left, not an error."""
    from eval.code_eval import complete, task_prompts
    from eval.code_tasks import Task
    from qlite.pipeline import load
    from tiny_models import make_checkpoint

    lm = load(make_checkpoint(tmp_path / "short", seed=2, max_position_embeddings=256), dtype="float32")
    task = Task("long", "f", "def f(x):\n    \"\"\"" + "the thin tin " * 2 + "\"\"\"", "assert f(1)")
    room = 256 - len(task_prompts(lm, [task])[0])
    assert 0 < room < 64
    ((text, n),) = complete(lm, [task], max_new_tokens=64, batch_size=2)
    assert 1 <= n <= room
