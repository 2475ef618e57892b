"""Eval text available offline, and chunking into fixed-length token windows.

Built-in sources (disjoint from the GPTQ calibration text in quantize/calib.py):
  code   Python standard-library source: the modules in CODE_MODULES, concatenated.
  prose  The GNU GPL v3 text that Debian's base-files installs at /usr/share/common-licenses/GPL-3.
Anything else: a path to a UTF-8 text file."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from qlite.errors import QliteError

CODE_MODULES = ("textwrap", "argparse", "difflib", "heapq", "fractions", "statistics", "shlex", "calendar")
PROSE_FILE = Path("/usr/share/common-licenses/GPL-3")
BUILTIN = ("code", "prose")


def module_source(name: str) -> str:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        raise QliteError(f"standard-library module {name} has no Python source here")
    return Path(spec.origin).read_text(encoding="utf-8")


def load_text(source: str) -> str:
    """The text of a built-in source name, or of a file."""
    if source == "code":
        return "\n\n".join(f"# file: {m}.py\n{module_source(m)}" for m in CODE_MODULES)
    if source == "prose":
        if not PROSE_FILE.exists():
            raise QliteError(f"--data prose: {PROSE_FILE} not found (Debian's base-files); give --data FILE")
        return PROSE_FILE.read_text(encoding="utf-8")
    path = Path(source)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise QliteError(f"--data {source}: not a built-in source ({', '.join(BUILTIN)}) nor a file") from None
    except (UnicodeDecodeError, IsADirectoryError) as e:
        raise QliteError(f"--data {source}: not a UTF-8 text file ({e})") from None
    if not text.strip():
        raise QliteError(f"--data {source}: empty")
    return text


def chunk_tokens(ids: list[int], ctx: int, max_chunks: int | None = None) -> list[list[int]]:
    """Consecutive, non-overlapping windows of exactly ctx tokens (a short tail is dropped)."""
    if ctx < 2:
        raise QliteError(f"--ctx {ctx}: must be at least 2")
    chunks = [ids[i:i + ctx] for i in range(0, len(ids) - ctx + 1, ctx)]
    if not chunks:
        raise QliteError(f"the text has {len(ids)} tokens, fewer than one --ctx {ctx} chunk")
    return chunks[:max_chunks] if max_chunks else chunks
