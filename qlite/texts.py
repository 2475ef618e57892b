"""Built-in text available offline, read by both the quantizer (calibration) and the eval harness;
the two sets are disjoint, so no eval text is ever calibrated on.

Eval:        code   Python standard-library source: the modules in EVAL_CODE_MODULES, concatenated.
             prose  The GNU GPL v3 text that Debian's base-files installs at /usr/share/common-licenses/GPL-3.
Calibration: half Python standard-library source (CALIB_MODULES), half English prose from the
             reference text in Python's pydoc_data package; or (`chat`) coding conversations: qlite's
             built-in code tasks (code_tasks.jsonl, which `qlite eval --tasks builtin` asks) as questions,
             their reference code as answers.
Anything else: a path to a UTF-8 text file."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from .errors import QliteError
from .files import read_text

EVAL_CODE_MODULES = ("textwrap", "argparse", "difflib", "heapq", "fractions", "statistics", "shlex", "calendar")
CALIB_MODULES = ("inspect", "typing", "dataclasses", "pathlib", "functools", "enum", "tarfile", "csv",
                 "logging", "ast")
PROSE_FILE = Path("/usr/share/common-licenses/GPL-3")
BUILTIN = ("code", "prose")
MAX_TEXT_BYTES = 2**30  # an eval or calibration text file is read whole (and tokenized): at most 1 GiB
CODE_TASKS_FILE = Path(__file__).with_name("code_tasks.jsonl")  # the built-in code tasks (eval/code_tasks.py)
CODE_INSTRUCTION = ("Reply with the complete code (the whole function or class, with the imports it needs) in "
                    "one ```python code block, without tests or usage examples.")


def code_question(prompt: str, prose: bool = False) -> str:
    """A code task as a chat message: a prose instruction, or a stub to complete."""
    if prose:
        return f"{prompt}\n\n{CODE_INSTRUCTION}"
    return f"Complete the following Python code.\n\n```python\n{prompt}\n```\n\n{CODE_INSTRUCTION}"


def coding_conversations() -> list[tuple[str, str]]:
    """(question, answer) per built-in code task: code_question, and its reference code in a fenced block."""
    pairs = []
    for line in CODE_TASKS_FILE.read_text(encoding="utf-8").splitlines():
        task = json.loads(line)
        prose = task.get("prose", False)
        reference = task["solution"] if prose else f"{task['prompt']}\n{task['solution']}"
        pairs.append((code_question(task["prompt"], prose), f"```python\n{reference.strip()}\n```"))
    return pairs


def module_source(name: str) -> str:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        raise QliteError(f"standard-library module {name} has no Python source here")
    return Path(spec.origin).read_text(encoding="utf-8")


def modules_text(modules) -> str:
    return "\n\n".join(f"# file: {m}.py\n{module_source(m)}" for m in modules)


def calibration_texts() -> tuple[str, str]:
    """(code, prose) built-in calibration text."""
    from pydoc_data.topics import topics

    return modules_text(CALIB_MODULES), "\n\n".join(topics[k] for k in sorted(topics))


def load_text(source: str, flag: str = "--data") -> str:
    """The text of a built-in eval source name (code, prose), or of a file."""
    if source == "code":
        return modules_text(EVAL_CODE_MODULES)
    if source == "prose":
        if not PROSE_FILE.exists():
            raise QliteError(f"{flag} prose: {PROSE_FILE} not found (Debian's base-files); give {flag} FILE")
        return PROSE_FILE.read_text(encoding="utf-8")
    path = Path(source)
    if not path.exists() and not path.is_symlink():
        raise QliteError(f"{flag} {source}: not a built-in source ({', '.join(BUILTIN)}) nor a file")
    try:
        text = read_text(path, limit=MAX_TEXT_BYTES)
    except QliteError as e:
        raise QliteError(f"{flag} {e}") from None
    if not text.strip():
        raise QliteError(f"{flag} {source}: empty")
    return text
