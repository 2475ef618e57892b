"""Dependencies run one way: checkpoint dir -> quantize -> quantized dir -> load -> generate / eval.
qlite/ imports neither quantize/ nor eval/ (only its CLI does, inside the commands that need them),
within qlite/ only the CLI imports the serving package qlite/serve/,
quantize/ does not import eval/, nothing but the developers' benchmarks imports eval/benchmarks/, and no module imports itself back through others."""
import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("qlite", "quantize", "eval")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """The project modules a file imports, anywhere in it (lazy imports included)."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names]  # a module, or a name from module `base`
        else:
            continue
        found |= {n for n in names if n.split(".")[0] in PACKAGES}
    return found


def graph() -> dict[str, set[str]]:
    files = {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    resolve = lambda m: m if m in files else m.rpartition(".")[0]  # noqa: E731
    return {name: {resolve(m) for m in imports(p)} - {name} for name, p in files.items()}


def test_dependencies_run_one_way():
    g = graph()
    assert {"qlite.cli", "quantize.convert", "eval.run"} <= set(g)
    for mod, deps in g.items():
        roots = {d.split(".")[0] for d in deps}
        if mod.startswith("quantize"):
            assert "eval" not in roots, f"{mod} imports {deps}"
        if mod.startswith("qlite") and mod != "qlite.cli":
            assert roots <= {"qlite"}, f"{mod} imports {deps}"
        if not mod.startswith("eval.benchmarks"):
            assert not {d for d in deps if d.startswith("eval.benchmarks")}, f"{mod} imports a benchmark: {deps}"
        if mod.startswith("qlite") and mod != "qlite.cli" and not mod.startswith("qlite.serve"):
            assert not {d for d in deps if d.startswith("qlite.serve")}, f"{mod} imports the serving package: {deps}"


def test_no_import_cycles():
    g = graph()
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(mod, path):
        state[mod] = 1
        for dep in sorted(g[mod]):
            assert state.get(dep) != 1, "import cycle: " + " -> ".join(path + [mod, dep])
            if dep not in state:
                visit(dep, path + [mod])
        state[mod] = 2

    for mod in sorted(g):
        if mod not in state:
            visit(mod, [])


def test_importing_qlite_loads_neither_quantize_nor_eval():
    code = ("import sys, pkgutil, importlib, qlite\n"
            "for m in pkgutil.iter_modules(qlite.__path__):\n"
            "    if m.name != '__main__': importlib.import_module('qlite.' + m.name)\n"
            "print(sorted({n.split('.')[0] for n in sys.modules} & {'quantize', 'eval'}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
