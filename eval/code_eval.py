"""Does the model still write working code? Greedy chat completions of the code tasks
(code_tasks.py), the code taken from each answer and run against the task's hidden tests in the
sandbox (sandbox.py), several at once. Per model: pass rate with its standard error, the paired
difference to the baseline (the same tasks, passed by one and not the other), and the KLD on the
baseline's own answers: each model reads the baseline's prompt + answer tokens and is compared with
the baseline token by token there, where generation actually goes (text KLD measures elsewhere)."""
from __future__ import annotations

import math
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qlite.errors import QliteError
from qlite.fidelity import Fidelity, token_stats
from qlite.generate import SamplingParams
from qlite.texts import code_question
from qlite.tokenizer import Tokenizer

from .code_tasks import Task
from .gguf_peer import GgufPeer, is_gguf
from .sandbox import Limits, run_python


FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.S | re.I)


def task_message(task: Task) -> str:
    return code_question(task.prompt, task.prose)


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
    answer_fidelity: dict = field(default_factory=dict)  # Fidelity.summary() on the baseline's answers
    text: dict = field(default_factory=dict)  # size and KLD on the built-in texts (eval.benchmarks.functional)

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

    def compared(self) -> str:
        """Its table cells: passed | pass rate | +won / -lost | difference | KLD on the baseline's answers | top-1."""
        vs = (f"+{self.paired['wins']} / -{self.paired['losses']} | {100 * self.paired['diff']:+.1f} ± "
              f"{100 * self.paired['diff_err']:.1f} pp") if self.paired else "(baseline) | "
        f = self.answer_fidelity
        answers = f"{f['kld_mean']:.4f} ± {f['kld_mean_err']:.4f} | {100 * f['top1']:.2f}%" if f else " | "
        return f"{self.passed} | {100 * self.pass_rate:.1f}% ± {100 * self.pass_rate_err:.1f} | {vs} | {answers}"

    def summary(self) -> dict:
        return {"model": self.model, "tasks": len(self.results), "passed": self.passed,
                "pass_rate": self.pass_rate, "pass_rate_err": self.pass_rate_err, "tokens": self.tokens,
                "seconds": self.seconds, **self.paired, "answer_fidelity": self.answer_fidelity, "text": self.text,
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


def task_prompts(lm, tasks: list[Task]) -> list[list[int]]:
    return [lm.prompt_ids(task_message(t), chat=True) for t in tasks]


def complete(lm, tasks: list[Task], max_new_tokens: int, batch_size: int, progress: bool = False,
             answer_ids: list | None = None) -> list[tuple[str, int]]:
    """Greedy answers (text, tokens generated) of a TextModel to the tasks, decoded `batch_size` at a time
    by the serving engine's continuous batching (a finished answer's row goes to the next task at once;
    each row's tokens are the prompt's alone, engine.py); each answer's token ids go into answer_ids."""
    import threading

    from tqdm import tqdm

    from qlite.decode import Done, Failed, Shaping, Text, Token
    from qlite.serve.engine import Engine, Job

    prompts = task_prompts(lm, tasks)
    params = SamplingParams(max_new_tokens=max_new_tokens)
    ctx = min(max(map(len, prompts)) + max_new_tokens, lm.model.config.context_length)
    engine = Engine(lm, max_batch=batch_size, ctx=ctx, max_queue=len(tasks), prompt_cache_bytes=0)
    texts, ids = [[] for _ in tasks], [[] for _ in tasks]
    failed, left = [], threading.Semaphore(0)
    bar = tqdm(total=len(tasks), desc="answers", unit="task", disable=not progress, leave=False)

    def emit(i, event):
        if isinstance(event, Text):
            texts[i].append(event.text)
        elif isinstance(event, Token):
            ids[i].append(event.id)
        elif isinstance(event, (Done, Failed)):
            if isinstance(event, Failed):
                failed.append(f"{tasks[i].name}: {event.message}")
            bar.update()
            left.release()

    for i in sorted(range(len(tasks)), key=lambda i: len(prompts[i])):  # similar lengths prefill together
        room = max(1, min(max_new_tokens, ctx - len(prompts[i])))  # a prompt past the context: the engine says so
        engine.submit(Job(prepare=lambda i=i: prompts[i], params=params, emit=lambda e, i=i: emit(i, e),
                          max_tokens=room, shaping=Shaping(logprobs=0)))
    engine.start()
    try:
        for _ in tasks:
            left.acquire()
    finally:
        engine.stop()
        bar.close()
    if failed:
        raise QliteError(f"code tasks: generation failed: {failed[0]}")
    eos = set(lm.eos_ids)
    if answer_ids is not None:
        answer_ids[:] = [[t for t in row if t not in eos] for row in ids]
    return [("".join(t), sum(tok not in eos for tok in row)) for t, row in zip(texts, ids)]


def score(tasks: list[Task], answers: list[tuple[str, int]], limits: Limits, workers: int | None = None,
          progress: bool = False) -> list[TaskResult]:
    """Each answer's code against its task's tests, `workers` sandboxes at a time (default: one per core)."""
    from tqdm import tqdm

    def run(pair):
        task, (text, n) = pair
        result = run_python(extract_code(text, task.entry) + "\n\n" + task.tests, limits)
        return TaskResult(task.name, result.passed, result.reason, n, text)

    with ThreadPoolExecutor(workers or os.cpu_count() or 1) as pool:
        return list(tqdm(pool.map(run, zip(tasks, answers)), total=len(tasks), desc="sandbox", unit="task",
                         disable=not progress, leave=False))


@torch.inference_mode()
def answer_fidelity(models: dict, base, sequences: list[tuple[list[int], list[int]]]) -> dict[str, dict]:
    """Per model (name -> CausalLM): Fidelity against the baseline on the baseline's own answers, each
    (prompt ids, answer ids) read in one pass by the baseline (once) and by every model, compared on
    the answer's tokens."""
    fidelity = {name: Fidelity() for name in models}
    for prompt, answer in sequences:
        if not answer:
            continue
        ids = torch.tensor([prompt + answer])  # (1, T)
        scored = slice(len(prompt) - 1, ids.shape[1] - 1)  # the positions that predict the answer's tokens
        base_logp = torch.log_softmax(base(ids)[0, scored].float(), dim=-1)  # (answer, V)
        for name, model in models.items():
            fidelity[name].add(token_stats(base_logp, model(ids)[0, scored], ids[0, len(prompt):]))
    return {name: f.summary() if f.parts else {} for name, f in fidelity.items()}


def evenly(n: int, k: int) -> list[int]:
    """k indices spread evenly over range(n) (all of them when k >= n)."""
    return list(range(n)) if k >= n else [i * n // k for i in range(k)]


def complete_gguf(peer, lm, tasks: list[Task], prompts: list[list[int]], max_new_tokens: int, ctx: int,
                  progress: bool = False, answer_ids: list | None = None) -> list[tuple[str, int]]:
    """complete()'s answers from llama.cpp (a GgufPeer): the same prompt ids, greedy, one task at a time,
    each answer as long as the context leaves room for (as complete()'s)."""
    from tqdm import tqdm

    stop, ids = set(lm.eos_ids), []
    for task, prompt in tqdm(list(zip(tasks, prompts)), desc="answers (llama.cpp)", unit="task",
                             disable=not progress, leave=False):
        if len(prompt) >= ctx:
            raise QliteError(f"code tasks: {task.name}: the prompt's {len(prompt)} tokens leave no room in the "
                             f"model's context of {ctx}")
        ids.append(peer.greedy(prompt, min(max_new_tokens, ctx - len(prompt)), stop))
    if answer_ids is not None:
        answer_ids[:] = ids
    return [(lm.tokenizer.decode(row), len(row)) for row in ids]


def answer_tasks(model_dir: Path, tasks: list[Task], dtype: str = "auto", max_new_tokens: int = 512,
                 batch_size: int = 8, limits: Limits = Limits(), progress: bool = True,
                 prompter: Path | None = None) -> tuple[CodeRow, list]:
    """One model's row (answers scored in the sandbox) and its (prompt ids, answer ids) per task. A
    GGUF file answers through llama.cpp, asked with the prompt ids of `prompter` (the baseline's dir:
    its tokenizer and chat template)."""
    from qlite.pipeline import load

    gguf = is_gguf(Path(model_dir))
    if gguf and prompter is None:
        raise QliteError(f"{model_dir}: a GGUF answers the baseline's prompts; give the baseline's dir")
    lm = load(prompter if gguf else model_dir, dtype=dtype)
    if lm.tokenizer.chat_template is None:
        raise QliteError(f"{prompter if gguf else model_dir}: has no chat template; the code tasks are asked as "
                         "chat messages")
    t0 = time.perf_counter()
    prompts, ids = task_prompts(lm, tasks), [[] for _ in tasks]
    if gguf:
        ctx = min(max(map(len, prompts)) + max_new_tokens, lm.model.config.context_length)
        peer = GgufPeer(model_dir, ctx, lm.tokenizer, lm.model.config.vocab_size)
        answers = complete_gguf(peer, lm, tasks, prompts, max_new_tokens, ctx, progress, ids)
    else:
        answers = complete(lm, tasks, max_new_tokens, batch_size, progress, ids)
    row = CodeRow(Path(model_dir).name, score(tasks, answers, limits, progress=progress), time.perf_counter() - t0)
    return row, list(zip(prompts, ids))


def compare_rows(rows: list[CodeRow], dirs: list[Path], base_sequences: list, dtype: str = "auto",
                 fidelity_tasks: int = 64) -> None:
    """Fill every row but the first (the baseline's) with its paired difference, and, where it has none
    yet, its fidelity on the baseline's answers to `fidelity_tasks` tasks spread evenly (0: none), read
    with the baseline and those models loaded together."""
    from qlite.loader import load_model

    for row in rows[1:]:
        row.paired = paired_difference(row, rows[0])
    todo = [(row, d) for row, d in zip(rows[1:], dirs[1:]) if not row.answer_fidelity]
    if fidelity_tasks and todo:
        chosen = [base_sequences[i] for i in evenly(len(base_sequences), fidelity_tasks)]
        base = load_model(dirs[0], dtype=dtype)
        ctx = max(len(prompt) + len(answer) for prompt, answer in chosen)
        models = {row.model: GgufPeer(d, ctx, Tokenizer(dirs[0]), base.config.vocab_size) if is_gguf(Path(d))
                  else load_model(d, dtype=dtype) for row, d in todo}
        for (row, _), summary in zip(todo, answer_fidelity(models, base, chosen).values()):
            row.answer_fidelity = summary


def evaluate_code(model_dirs, baseline, tasks: list[Task], dtype: str = "auto", max_new_tokens: int = 512,
                  batch_size: int = 8, limits: Limits = Limits(), progress: bool = True,
                  fidelity_tasks: int = 64) -> list[CodeRow]:
    """The baseline first, then each model, one loaded at a time (answer_tasks), then compare_rows."""
    from tqdm import tqdm

    dirs = [Path(baseline), *map(Path, model_dirs)]
    rows, base_sequences = [], None
    for d in tqdm(dirs, desc="code tasks", unit="model", disable=not progress):
        row, sequences = answer_tasks(d, tasks, dtype, max_new_tokens, batch_size, limits, progress, dirs[0])
        rows.append(row)
        base_sequences = base_sequences or sequences
    compare_rows(rows, dirs, base_sequences, dtype, fidelity_tasks)
    return rows


def code_table(rows: list[CodeRow]) -> str:
    head = ("| model | tasks | passed | pass rate | vs baseline: +won / -lost | difference | KLD on the baseline's "
            "answers | top-1 there | tokens | time |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(f"| {r.model} | {len(r.results)} | {r.compared()} | {r.tokens} | {r.seconds:.0f} s |")
    lines.append("")
    lines.append("Greedy chat answers; the code of each answer runs against the task's hidden tests in a sandbox "
                 "(time, memory and output limits, no network). ± is one standard error; the difference is "
                 "paired (the same tasks). KLD on the baseline's answers: KL(baseline || model) per token, in nats, "
                 "with both reading the baseline's prompt and greedy answer, on the answer's tokens.")
    return "\n".join(lines)
