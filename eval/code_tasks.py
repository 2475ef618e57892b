"""Functional code tasks: a stub (signature and docstring) or a prose instruction, a reference
solution (used only to check the task itself), and hidden tests (asserts). The built-in ones, written
for qlite (standard library only; strings, lists, dicts, math, recursion, parsing, classes, edge
cases, prose), are data: qlite/code_tasks.jsonl (there, so that the quantizer's `chat` calibration
text can read them too), in the --tasks FILE format."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from qlite.errors import QliteError
from qlite.fields import field_of
from qlite.files import read_text
from qlite.texts import CODE_TASKS_FILE

MAX_TASKS_BYTES = 64 * 2**20  # a --tasks JSON Lines file
BUILTIN_FILE = CODE_TASKS_FILE


@dataclass(frozen=True)
class Task:
    name: str
    entry: str  # the function or class the tests call
    prompt: str  # a stub (signature + docstring) or, for prose tasks, an instruction
    tests: str  # Python asserts, run after the answer's code
    solution: str = ""  # stub + solution passes the tests (checked in tests/eval)
    prose: bool = False  # the prompt is an instruction, the solution a whole program

    @property
    def reference(self) -> str:
        return self.solution if self.prose else f"{self.prompt}\n{self.solution}"


def load_tasks(source: str | Path) -> list[Task]:
    """`builtin` or a JSON Lines file of tasks (name, entry, prompt, tests; optional solution, prose);
    `--tasks suite` is task_sources.tasks_named's."""
    path = BUILTIN_FILE if source == "builtin" else Path(source).expanduser()
    try:
        lines = read_text(path, limit=MAX_TASKS_BYTES).splitlines()
    except QliteError as e:
        raise QliteError(f"--tasks {e}") from None
    tasks = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{i}"
        try:
            d = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as e:
            raise QliteError(f"{where}: not a task (a JSON object with name, entry, prompt, tests: {e})") from None
        if not isinstance(d, dict):
            raise QliteError(f"{where}: not a task (a JSON object with name, entry, prompt, tests)")
        tasks.append(Task(*(field_of(d, k, str, where) for k in ("name", "entry", "prompt", "tests")),
                          field_of(d, "solution", str, where, ""), field_of(d, "prose", bool, where, False)))
    if not tasks:
        raise QliteError(f"{path}: holds no tasks")
    return tasks


def dump_tasks(tasks: list[Task], path: Path) -> None:
    """Write tasks as JSON Lines (the --tasks FILE format)."""
    Path(path).write_text("".join(json.dumps(asdict(t)) + "\n" for t in tasks), encoding="utf-8")


TASKS = load_tasks("builtin")
