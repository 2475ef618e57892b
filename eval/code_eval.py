"""Does the model still write working code? Greedy chat completions of the code tasks
(code_tasks.py), the code taken from each answer and run against the task's hidden tests in the
sandbox (sandbox.py). Per model: pass rate with its standard error, and the paired difference to
the baseline (the same tasks, passed by one and not the other)."""
from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from qlite.errors import QliteError
from qlite.decode import generate_tokens
from qlite.generate import SamplingParams

from .code_tasks import Task
from .sandbox import Limits, run_python

INSTRUCTION = ("Reply with the complete code (the whole function or class, with the imports it needs) in "
               "one ```python code block, without tests or usage examples.")
FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.S | re.I)


def task_message(task: Task) -> str:
    if task.prose:
        return f"{task.prompt}\n\n{INSTRUCTION}"
    return f"Complete the following Python code.\n\n```python\n{task.prompt}\n```\n\n{INSTRUCTION}"


def extract_code(answer: str, entry: str) -> str:
    """The code of an answer: its fenced blocks that define `entry` (all blocks if none does, the
    whole answer if it has no fence); a block's own tests after the definition stay (they are the
    model's to get right)."""
    blocks = FENCE.findall(answer)
    if not blocks:
        return answer
    defining = [b for b in blocks if re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{re.escape(entry)}\b", b, re.M)]
    return "\n\n".join(defining or blocks)


@dataclass
class TaskResult:
    name: str
    passed: bool
    reason: str
    tokens: int
    answer: str = ""  # the model's whole answer, for reading in the JSON report


@dataclass
class CodeRow:
    model: str
    results: list[TaskResult]
    seconds: float
    paired: dict = field(default_factory=dict)  # against the baseline: wins, losses, diff, diff_err

    @property
    def passed(self) -> int:
        return sum(r.passed for r in self.results)

    @property
    def pass_rate(self) -> float:
        return self.passed / len(self.results)

    @property
    def pass_rate_err(self) -> float:
        p, n = self.pass_rate, len(self.results)
        return math.sqrt(p * (1 - p) / n)

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.results)

    def summary(self) -> dict:
        return {"model": self.model, "tasks": len(self.results), "passed": self.passed,
                "pass_rate": self.pass_rate, "pass_rate_err": self.pass_rate_err, "tokens": self.tokens,
                "seconds": self.seconds, **self.paired,
                "results": [vars(r) for r in self.results]}


def paired_difference(model: CodeRow, base: CodeRow) -> dict:
    """Tasks passed by the model and not the baseline (wins) and the reverse (losses); the difference
    in pass rate and its standard error over the pairs (the discordant ones carry it)."""
    base_passed = {r.name: r.passed for r in base.results}
    wins = sum(r.passed and not base_passed[r.name] for r in model.results)
    losses = sum(base_passed[r.name] and not r.passed for r in model.results)
    n = len(model.results)
    err = math.sqrt(max(wins + losses - (wins - losses) ** 2 / n, 0.0)) / n
    return {"wins": wins, "losses": losses, "diff": (wins - losses) / n, "diff_err": err}


def complete(lm, tasks: list[Task], max_new_tokens: int, batch_size: int) -> list[tuple[str, int]]:
    """Greedy answers (text, tokens generated) of a TextModel to the tasks, prompts of similar
    length decoded together in left-padded batches."""
    prompts = [lm.prompt_ids(task_message(t), chat=True) for t in tasks]
    order = sorted(range(len(tasks)), key=lambda i: len(prompts[i]))
    params = SamplingParams(max_new_tokens=max_new_tokens)
    eos, pad = set(lm.eos_ids), lm.tokenizer.pad_token_id or 0
    answers: list[tuple[str, int]] = [("", 0)] * len(tasks)
    for start in range(0, len(order), batch_size):
        batch = order[start:start + batch_size]
        tokens: list[list[int]] = [[] for _ in batch]
        ended = [False] * len(batch)
        for step in generate_tokens(lm.model, [prompts[i] for i in batch], params, lm.eos_ids, pad_id=pad):
            for row, t in enumerate(step.tolist()):
                if not ended[row]:
                    ended[row] = t in eos
                    if not ended[row]:
                        tokens[row].append(t)
        for row, i in enumerate(batch):
            answers[i] = (lm.tokenizer.decode(tokens[row], skip_special_tokens=True), len(tokens[row]))
    return answers


def score(tasks: list[Task], answers: list[tuple[str, int]], limits: Limits) -> list[TaskResult]:
    results = []
    for task, (text, n) in zip(tasks, answers):
        run = run_python(extract_code(text, task.entry) + "\n\n" + task.tests, limits)
        results.append(TaskResult(task.name, run.passed, run.reason, n, text))
    return results


def evaluate_code(model_dirs, baseline, tasks: list[Task], dtype: str = "auto", max_new_tokens: int = 512,
                  batch_size: int = 8, limits: Limits = Limits(), progress: bool = True) -> list[CodeRow]:
    """The baseline first, then each model; every row but the baseline's carries its paired difference."""
    from tqdm import tqdm

    from qlite.pipeline import load

    rows = []
    for d in tqdm([Path(baseline), *map(Path, model_dirs)], desc="code tasks", unit="model", disable=not progress):
        lm = load(d, dtype=dtype)
        if lm.tokenizer.chat_template is None:
            raise QliteError(f"{d}: has no chat template; the code tasks are asked as chat messages")
        t0 = time.perf_counter()
        answers = complete(lm, tasks, max_new_tokens, batch_size)
        seconds = time.perf_counter() - t0
        del lm
        rows.append(CodeRow(d.name, score(tasks, answers, limits), seconds))
    for row in rows[1:]:
        row.paired = paired_difference(row, rows[0])
    return rows


def code_table(rows: list[CodeRow]) -> str:
    head = "| model | tasks | passed | pass rate | vs baseline: +won / -lost | difference | tokens | time |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for i, r in enumerate(rows):
        vs = (f"+{r.paired['wins']} / -{r.paired['losses']} | {100 * r.paired['diff']:+.1f} ± "
              f"{100 * r.paired['diff_err']:.1f} pp") if r.paired else "(baseline) | "
        lines.append(f"| {r.model} | {len(r.results)} | {r.passed} | {100 * r.pass_rate:.1f}% ± "
                     f"{100 * r.pass_rate_err:.1f} | {vs} | {r.tokens} | {r.seconds:.0f} s |")
    lines.append("")
    lines.append("Greedy chat answers; the code of each answer runs against the task's hidden tests in a sandbox "
                 "(time, memory and output limits, no network). ± is one standard error; the difference is "
                 "paired (the same tasks).")
    return "\n".join(lines)
