"""The docs say what the code does: docs/commands.md's options are rendered from the CLI, its prose
names only flags the CLI has, every relative link resolves, and BENCHMARKS.md is newest first."""
import re
from pathlib import Path

import click

from qlite.arch import ARCHITECTURES
from qlite.cli import cli
from qlite.cli_docs import BEGIN, END, render, rewrite

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]


def cli_flags() -> set[str]:
    ctx = click.Context(cli, info_name="qlite")
    commands = [cli, *(cli.get_command(ctx, name) for name in cli.list_commands(ctx))]
    return {opt for cmd in commands for p in cmd.params if isinstance(p, click.Option) for opt in p.opts + p.secondary_opts}


def test_the_commands_page_is_rendered_from_the_cli():
    page = (ROOT / "docs/commands.md").read_text()
    assert rewrite(page, render()) == page, "docs/commands.md is stale: run python -m qlite.cli_docs docs/commands.md"


def test_the_rendered_part_has_every_command_and_option():
    rendered = render()
    ctx = click.Context(cli, info_name="qlite")
    for name in cli.list_commands(ctx):
        assert f"### `qlite {name}`" in rendered
    assert all(f"`{flag}" in rendered or f", {flag}" in rendered for flag in cli_flags())
    assert "native-a16" in rendered and "--version" in rendered and "/quit" in rendered


def test_the_prose_names_only_flags_the_cli_has():
    page = (ROOT / "docs/commands.md").read_text()
    prose = page[:page.index(BEGIN)] + page[page.index(END):]
    named = set(re.findall(r"`(--[a-z][a-z0-9-]*)", prose))
    assert named and named <= cli_flags(), named - cli_flags()


def test_import_gguf_names_every_architecture_it_reads():
    help_text = cli.get_command(click.Context(cli), "import-gguf").help
    assert all(a.gguf_arch in help_text for a in ARCHITECTURES.values())


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # an absolute URL
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.name}: {target}")
            elif anchor and linked.suffix == ".md":
                anchors = {slug(h) for h in re.findall(r"^#+ (.*)$", linked.read_text(), re.M)}
                if anchor not in anchors:
                    broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, broken


def test_benchmarks_are_newest_first():
    headings = re.findall(r"^## (.*)$", (ROOT / "BENCHMARKS.md").read_text(), re.M)
    dates = [m.group(0) for h in headings if (m := re.search(r"20\d\d-\d\d-\d\d", h))]
    assert len(dates) >= len(headings) - 2 and dates == sorted(dates, reverse=True)



def test_no_table_is_broken_by_a_blank_line():
    """A row after a blank line that follows a table is the table's lost tail, unless it is a new
    table's header (its |---| line next)."""
    broken = []
    for page in PAGES:
        lines = page.read_text().splitlines() + [""]
        for i in range(1, len(lines) - 2):
            if (lines[i - 1].startswith("|") and not lines[i].strip() and lines[i + 1].startswith("|")
                    and not lines[i + 2].startswith("|-")):
                broken.append(f"{page.name}:{i + 1}")
    assert not broken, broken


def test_every_environment_variable_the_runtime_reads_is_documented():
    source = "\n".join(f.read_text() for f in (ROOT / "qlite").rglob("*.py"))
    read = set(re.findall(r"environ(?:\.get)?[\[(]\"([A-Z_]+)\"", source))
    page = (ROOT / "docs/commands.md").read_text()
    assert {"QLITE_CACHE", "CC"} <= read and all(f"`{name}" in page for name in read), read


def test_the_internals_page_names_every_eval_module():
    page = (ROOT / "docs/internals.md").read_text()
    modules = [f.name for f in (ROOT / "eval").rglob("*.py") if f.name != "__init__.py"]
    assert len(modules) >= 16 and all(f"`{name}`" in page for name in modules), modules


def test_the_runtimes_python_quotes_no_measured_speed():
    """Figures measured on one CPU go stale in docstrings; they belong in BENCHMARKS.md (the C kernels'
    comments keep the measurements that chose their designs)."""
    figure = re.compile(r"\d\.\d+x\b|\d+x (?:faster|slower)|\d ms\b|GFLOP/s|GB/s")
    found = [f"{f.relative_to(ROOT)}:{i}" for f in (ROOT / "qlite").rglob("*.py")
             for i, line in enumerate(f.read_text().splitlines(), 1) if figure.search(line)]
    assert not found, found


def test_every_figure_the_readme_quotes_names_its_run():
    """A paragraph of the README that quotes a measured figure names the BENCHMARKS.md run it comes from
    (a section, or the page with the command beside the figure)."""
    text = re.sub(r"```.*?```", "", (ROOT / "README.md").read_text(), flags=re.S)
    text = re.sub(r"<!-- (\S+) -->.*?<!-- /\1 -->", lambda m: m.group(0).replace("\n\n", "\n"), text, flags=re.S)
    figure = re.compile(r"\d\.\d+x\b|\d+(?:\.\d+)? ?tok(?:en)?s/s|\b0\.\d{3,}|\d ± \d")
    unnamed = [p[:80] for p in text.split("\n\n")
               if figure.search(p) and not p.lstrip().startswith("|") and "BENCHMARKS.md" not in p]
    assert not unnamed, unnamed
