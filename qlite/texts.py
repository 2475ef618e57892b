"""Built-in text available offline, read by both the quantizer (calibration) and the eval harness;
the two sets are disjoint, so no eval text is ever calibrated on.

Eval:        code   Python standard-library source: the modules in EVAL_CODE_MODULES, concatenated.
             prose  The GNU GPL v3 text that Debian's base-files installs at /usr/share/common-licenses/GPL-3.
Calibration: half Python standard-library source (CALIB_MODULES), half English prose from the
             reference text in Python's pydoc_data package.
Anything else: a path to a UTF-8 text file."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from .errors import QliteError
from .files import read_text

EVAL_CODE_MODULES = ("textwrap", "argparse", "difflib", "heapq", "fractions", "statistics", "shlex", "calendar")
CALIB_MODULES = ("inspect", "typing", "dataclasses", "pathlib", "functools", "enum", "tarfile", "csv",
                 "logging", "ast")
PROSE_FILE = Path("/usr/share/common-licenses/GPL-3")
BUILTIN = ("code", "prose")
MAX_TEXT_BYTES = 2**30  # an eval or calibration text file is read whole (and tokenized): at most 1 GiB


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
