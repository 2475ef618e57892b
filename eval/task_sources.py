"""A functional suite built from public sources on PyPI: MIT-licensed Python packages whose source
distributions carry their own unit tests. A task is one of the package's top-level functions: the
prompt is its signature and docstring (with the module's standard-library imports), the hidden tests
are the package's test methods that call that function and nothing else of the package, and the
package's own body is the reference. A task is kept only when its reference passes its tests alone
in the sandbox (a function that leans on the package's other helpers drops out).

`qlite eval --tasks suite` builds it once (pip downloads the pinned sdists; nothing else is fetched)
and caches the JSON Lines under ~/.cache/qlite/tasks/."""
from __future__ import annotations

import ast
import subprocess
import sys
import tarfile
import tempfile
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from qlite.errors import QliteError
from qlite.outputs import atomic_output_file
from qlite.system import cache_dir

from .code_tasks import Task, dump_tasks, load_tasks
from .sandbox import Limits, run_python

SUITE_VERSION = 1  # bump when the extraction changes: the cached file is named by it


@dataclass(frozen=True)
class Source:
    dist: str  # the PyPI name
    version: str
    package: str  # the import name, a folder of the sdist
    license: str

    @property
    def pin(self) -> str:
        return f"{self.dist}=={self.version}"


SOURCES = (
    Source("algorithms", "1.0.1", "algorithms", "MIT"),  # keon/algorithms: textbook algorithms
    Source("more-itertools", "11.2.1", "more_itertools", "MIT"),  # iterator recipes and tools
)


@dataclass(frozen=True)
class Function:
    stub: str  # standard-library imports, signature and docstring
    body: str  # the rest of the function: the reference solution


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _bound(alias: ast.alias, node: ast.stmt) -> str:
    return alias.asname or (alias.name if isinstance(node, ast.ImportFrom) else alias.name.split(".")[0])


def _imports(tree: ast.Module) -> dict[str, tuple[str | None, ast.stmt, ast.alias]]:
    """Each name a module's top-level imports bind: (the top-level module it comes from, or None for a
    relative import; the statement; its alias)."""
    bound = {}
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)) and getattr(node, "module", "") != "__future__":
            for a in node.names:
                top = None if getattr(node, "level", 0) else (node.module if isinstance(node, ast.ImportFrom)
                                                               else a.name).split(".")[0]
                bound[_bound(a, node)] = (top, node, a)
    return bound


def _import_lines(names: set[str], imports: dict) -> list[str] | None:
    """The import statements that bind `names`, one name each; None if one of them comes from outside
    the standard library (the package itself, pytest, ...)."""
    lines = []
    for name in sorted(names & set(imports)):
        top, node, alias = imports[name]
        if top not in sys.stdlib_module_names:
            return None
        one = ast.ImportFrom(node.module, [alias], 0) if isinstance(node, ast.ImportFrom) else ast.Import([alias])
        lines.append(ast.unparse(one))
    return lines


def package_functions(package_dir: Path) -> dict[str, Function]:
    """Top-level, public, undecorated functions with a docstring and a body, by name. The stub carries
    the standard-library imports the function uses and the module's own definitions it leans on
    (helpers, constants), in file order; a function that uses another module of the package is left
    out, and so is a name defined in two modules (the tests could mean either)."""
    found: dict[str, list[Function]] = defaultdict(list)
    for path in sorted(package_dir.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        tree, source = ast.parse(text), text.splitlines()
        imports = _imports(tree)
        defined = {}  # top-level name -> its statement
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                defined[node.name] = node
            elif isinstance(node, ast.Assign):
                defined.update({t.id: node for t in node.targets if isinstance(t, ast.Name)})
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_") or node.decorator_list \
                    or ast.get_docstring(node) is None or len(node.body) < 2:
                continue
            deps, todo = set(), [node]
            while todo:  # the module's definitions it leans on, transitively
                for name in _names(todo.pop()) & set(defined) - {node.name}:
                    if defined[name] not in deps and defined[name] is not node:
                        deps.add(defined[name])
                        todo.append(defined[name])
            used = set().union(_names(node), *map(_names, deps))
            lines = _import_lines(used, imports)
            if lines is None:
                continue
            context = [ast.get_source_segment(text, d) for d in tree.body if d in deps]
            doc_end = node.body[0].end_lineno
            stub = "\n".join(source[node.lineno - 1:doc_end])
            body = "\n".join(source[doc_end:node.end_lineno])
            head = "\n".join(lines) + "\n\n" if lines else ""
            found[node.name].append(Function(head + "".join(c + "\n\n" for c in context) + stub, body))
    return {name: fs[0] for name, fs in found.items() if len(fs) == 1}


class _Rename(ast.NodeTransformer):
    """`mi.chunked` -> `chunked` (a module alias of the package), `ts` -> `two_sum` (a name alias)."""

    def __init__(self, modules: set[str], names: dict[str, str]):
        self.modules, self.names = modules, names

    def visit_Attribute(self, node):
        if isinstance(node.value, ast.Name) and node.value.id in self.modules:
            return ast.copy_location(ast.Name(node.attr, node.ctx), node)
        return self.generic_visit(node)

    def visit_Name(self, node):
        return ast.copy_location(ast.Name(self.names.get(node.id, node.id), node.ctx), node)


def _test_units(tree: ast.Module) -> list[tuple[ast.FunctionDef, bool]]:
    """(test, is a unittest method): methods of TestCase classes without fixtures, and plain
    argument-less module-level test functions (pytest style, no fixtures or parametrize)."""
    units = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test") and not node.args.args \
                and not node.decorator_list:
            units.append((node, False))
        if isinstance(node, ast.ClassDef) and not node.decorator_list:
            methods = [m for m in node.body if isinstance(m, ast.FunctionDef)]
            if any(m.name in ("setUp", "setUpClass", "tearDown") for m in methods):
                continue
            units += [(m, True) for m in methods if m.name.startswith("test") and not m.decorator_list]
    return units


def package_tests(tests_dir: Path, package: str, functions: dict[str, Function]) -> dict[str, str]:
    """Per function: a test script (imports, then each test that calls that function and no other
    name of the package or the test module), which raises on the first failure."""
    units: dict[str, list[tuple[str, str, bool]]] = defaultdict(list)  # (test name, source, is a method)
    preambles: dict[str, set[str]] = defaultdict(set)
    for path in sorted(tests_dir.rglob("test*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        modules, names = set(), {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules |= {a.asname or a.name for a in node.names if a.name.split(".")[0] == package}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == package:
                for a in node.names:
                    if a.name in functions:
                        names[a.asname or a.name] = a.name
                    else:
                        modules.add(a.asname or a.name)
        local = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))} | {
            t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
        imports = _imports(tree)
        for test, is_method in _test_units(tree):
            test = _Rename(modules, names).visit(ast.parse(ast.unparse(test)).body[0])
            used = {n.id for n in ast.walk(test) if isinstance(n, ast.Name)}
            called = used & set(functions)
            if len(called) != 1 or used & (local | modules) - called:
                continue
            name = called.pop()
            lines = _import_lines(used - {name} - modules, imports)
            if lines is None:
                continue
            units[name].append((test.name, ast.unparse(test), is_method))
            preambles[name] |= set(lines)
    scripts = {}
    for name, tests in units.items():
        methods = [(test, src) for test, src, is_method in tests if is_method]
        plain = [(test, src) for test, src, is_method in tests if not is_method]
        lines = sorted(preambles[name])
        if methods:
            lines += ["import unittest", "class _Tests(unittest.TestCase):"]
            lines += ["\n".join("    " + line for line in src.splitlines()) for _, src in methods]
        lines += [src for _, src in plain]
        calls = [f"_Tests({test!r}).{test}()" for test, _ in methods] + [f"{test}()" for test, _ in plain]
        scripts[name] = "\n".join(lines + calls) + "\n"
    return scripts


def tasks_from_sdist(root: Path, source: Source) -> list[Task]:
    """Every candidate task of an unpacked sdist, before the reference check."""
    functions = package_functions(root / source.package)
    tests = package_tests(root / "tests", source.package, functions)
    return [Task(f"{source.dist}/{name}", name, functions[name].stub, script, functions[name].body)
            for name, script in sorted(tests.items())]


def unpack_sdist(source: Source, into: Path) -> Path:
    """pip downloads the pinned sdist (no dependencies, no build); its top folder, unpacked."""
    run = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                          source.pin, "-d", str(into)], capture_output=True, text=True)
    archives = sorted(into.glob(f"{source.dist.replace('-', '_')}-*.tar.gz")) or sorted(into.glob("*.tar.gz"))
    if run.returncode or not archives:
        last = (run.stderr.strip().splitlines() or ["no sdist"])[-1]
        raise QliteError(f"--tasks suite: pip could not download {source.pin}: {last}")
    with tarfile.open(archives[0]) as tar:
        tar.extractall(into / "src", filter="data")
    return next((into / "src").iterdir())


def sound(task: Task, limits: Limits = Limits(seconds=10)) -> bool:
    """The reference passes the task's tests alone, and the bare stub (a body of `pass`) does not."""
    stub = task.prompt + "\n" + " " * _body_indent(task.solution) + "pass"
    return run_python(task.reference + "\n\n" + task.tests, limits).passed and \
        not run_python(stub + "\n\n" + task.tests, limits).passed


def _body_indent(body: str) -> int:
    first = next(line for line in body.splitlines() if line.strip())
    return len(first) - len(first.lstrip())


def passing(tasks: list[Task], workers: int = 4) -> list[Task]:
    """The sound tasks, checked in parallel sandboxes."""
    with ThreadPoolExecutor(workers) as pool:
        return [t for t, ok in zip(tasks, pool.map(sound, tasks)) if ok]


def build_suite(out: Path, sources=SOURCES) -> list[Task]:
    tasks = []
    with tempfile.TemporaryDirectory(prefix="qlite-suite-") as tmp:
        for i, source in enumerate(sources):
            tasks += passing(tasks_from_sdist(unpack_sdist(source, Path(tmp) / str(i)), source))
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output_file(out, "--tasks suite") as tmp:
        dump_tasks(tasks, tmp)
    return tasks


def suite_path() -> Path:
    return cache_dir() / "tasks" / f"suite-v{SUITE_VERSION}" / "suite.jsonl"


def tasks_named(source: str) -> list[Task]:
    """What `--tasks` names: `suite` (load_suite), `builtin` or a JSON Lines file (load_tasks)."""
    return load_suite() if source == "suite" else load_tasks(source)


def load_suite() -> list[Task]:
    """The suite, built on first use."""
    path = suite_path()
    if not path.is_file():
        print(f"building the task suite from PyPI sdists ({', '.join(s.pin for s in SOURCES)}) into {path}",
              file=sys.stderr)
        build_suite(path)
    return load_tasks(path)
