"""docs/commands.md's reference part, rendered from the CLI itself: every command's usage, what it
does and every option with its default, so the page cannot say what the code does not.

    python -m qlite.cli_docs docs/commands.md    (rewrites the part between the markers)
"""
from __future__ import annotations

import inspect
import sys
from pathlib import Path

import click

BEGIN = "<!-- commands: rendered by `python -m qlite.cli_docs docs/commands.md`; edit the CLI, not this part -->"
END = "<!-- /commands -->"
ORDER = ("generate", "chat", "serve", "quantize", "eval", "info", "export", "import", "import-gguf", "fetch-demo")


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render_command(group: click.Group, name: str | None) -> str:
    """One command's section (name None: the group's own options)."""
    parent = click.Context(group, info_name="qlite", **group.context_settings)
    cmd = group if name is None else group.get_command(parent, name)
    ctx = parent if name is None else click.Context(cmd, info_name=name, parent=parent)
    usage = cmd.get_usage(ctx).removeprefix("Usage: ")
    what = "" if name is None else inspect.cleandoc(cmd.help or "").replace("\b\n", "")
    lines = [f"### `qlite{'' if name is None else ' ' + name}`", "", "```", usage, "```", "",
             *([what, ""] if what else []), "| option | what it does |", "|---|---|"]
    for param in cmd.get_params(ctx):
        record = param.get_help_record(ctx) if isinstance(param, click.Option) else None
        if record is not None:
            lines.append(f"| `{_cell(record[0])}` | {_cell(record[1])} |")
    return "\n".join(lines)


def render(group: click.Group | None = None) -> str:
    if group is None:
        from .cli import cli as group
    names = group.list_commands(click.Context(group, info_name="qlite"))
    missing = sorted(set(names) - set(ORDER))
    if missing:
        raise RuntimeError(f"qlite.cli_docs.ORDER lacks {missing}")
    body = "\n\n".join(render_command(group, n) for n in (None, *(n for n in ORDER if n in names)))
    return f"{BEGIN}\n{body}\n{END}"


def rewrite(page: str, rendered: str) -> str:
    """The page with its part between the markers replaced by `rendered` (which carries the markers)."""
    head, sep, rest = page.partition(BEGIN)
    _, sep2, tail = rest.partition(END)
    if not (sep and sep2):
        raise ValueError(f"the page lacks the markers {BEGIN!r} ... {END!r}")
    return head + rendered + tail


def main(argv: list[str]) -> int:
    from .outputs import write_file_atomic

    if len(argv) != 1:
        print("usage: python -m qlite.cli_docs docs/commands.md", file=sys.stderr)
        return 2
    path = Path(argv[0])
    write_file_atomic(path, rewrite(path.read_text(), render()), "the page")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
