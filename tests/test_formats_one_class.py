"""A format is one class (qlite/formats.py): nothing else branches on a format's class, scheme or bits,
and a format defined in a test alone quantizes, loads, runs, is refused by exports with one line and
appears in `qlite quantize --help`."""
import ast
import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from qlite import formats
from qlite.cli import main
from qlite.formats import REGISTRY, Format, fp16_scale

ROOT = Path(__file__).resolve().parents[1]
# kernels name the layouts they read (a kernel *is* per format), and kernel_bench times those kernels directly
ALLOWED = {"qlite/formats.py", "qlite/kernels.py", "eval/benchmarks/kernel_bench.py"}
FORMAT_CLASSES = {name for name, obj in vars(formats).items() if isinstance(obj, type) and issubclass(obj, Format)}


def branches_on_format(path: Path) -> list[str]:
    """isinstance checks against a format class, and comparisons of a scheme or bits."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and len(node.args) == 2:
            kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
            names = {k.id if isinstance(k, ast.Name) else getattr(k, "attr", None) for k in kinds}
            if names & FORMAT_CLASSES:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} isinstance of {sorted(names & FORMAT_CLASSES)}")
        if isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                if (isinstance(side, ast.Attribute) and side.attr in ("scheme", "bits")) or \
                        (isinstance(side, ast.Name) and side.id == "scheme"):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} compares {ast.unparse(side)}")
    return found


def test_nothing_outside_formats_branches_on_a_format():
    files = [p for pkg in ("qlite", "quantize", "eval") for p in (ROOT / pkg).rglob("*.py")
             if str(p.relative_to(ROOT)) not in ALLOWED]
    assert len(files) > 40
    assert [hit for p in files for hit in branches_on_format(p)] == []


def test_the_check_sees_a_branch(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("if isinstance(fmt, (Int4, Int8)) or fmt.bits == 4 or scheme in ('int',):\n    pass\n")
    hits = [h.split(" ", 1)[1] for h in branches_on_format_at(probe)]
    assert hits == ["isinstance of ['Int4', 'Int8']", "compares fmt.bits", "compares scheme"]


def branches_on_format_at(path: Path) -> list[str]:
    global ROOT
    saved, ROOT = ROOT, path.parent
    try:
        return branches_on_format(path)
    finally:
        ROOT = saved


# --- a toy format, defined here alone --------------------------------------------------------------

@dataclass(frozen=True)
class Ternary(Format, scheme="toy", bits=2):
    """Codes -1, 0, 1 times one fp16 scale per row (its mean absolute weight x 1.5)."""

    @property
    def name(self):
        return "toy2"

    @classmethod
    def parse(cls, name):
        return cls() if name == "toy2" else None

    @classmethod
    def make(cls, group_size, symmetric):
        return cls(None, True)

    def stored_shapes(self, out_features, in_features):
        return {"qweight": (torch.int8, (out_features, in_features)), "scales": (torch.float16, (out_features, 1))}

    def quantize_rows(self, w):
        scale = fp16_scale(1.5 * w.float().abs().mean(-1, keepdim=True))
        return {"qweight": torch.round(w.float() / scale).clamp(-1, 1).to(torch.int8), "scales": scale.half()}

    def dequantize(self, stored, in_features):
        return stored["qweight"].float() * stored["scales"].float()


del REGISTRY[("toy", 2)]  # registered only while a test uses it


@pytest.fixture
def toy_registered():
    REGISTRY[("toy", 2)] = Ternary
    yield
    del REGISTRY[("toy", 2)]


def cli(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_toy_format_quantizes_loads_runs_and_is_refused_by_exports(toy_registered, tiny_ckpt, tmp_path, capsys):
    code, out, _ = cli(capsys, "quantize", "--help")
    assert code == 0 and "toy" in re.sub(r"\s+", "", out.split("--format")[1].split("--lm-head-bits")[0])
    out_dir = tmp_path / "toy"
    code, out, err = cli(capsys, "quantize", tiny_ckpt, "--format", "toy", "--bits", "2", "--out", out_dir, "--no-report")
    assert code == 0, err
    q = json.loads((out_dir / "config.json").read_text())["quantization_config"]
    assert (q["scheme"], q["bits"], q["lm_head_format"]) == ("toy", 2, "int8")

    import qlite
    lm = qlite.load(out_dir, dtype="float32")
    linear = next(m for m in lm.model.modules() if getattr(m, "fmt", None) == Ternary())
    x = torch.randn(3, linear.in_features)
    want = x @ Ternary().dequantize(linear.stored(), linear.in_features).T + (0 if linear.bias is None else linear.bias)
    assert torch.allclose(linear(x).float(), want, atol=1e-4)
    code, out, err = cli(capsys, "generate", "-m", out_dir, "-p", "the thin tin", "--max-new-tokens", 4, "--raw")
    assert code == 0, err
    code, out, err = cli(capsys, "info", out_dir)
    assert code == 0 and "toy2" in out
    for target in ("gguf", "compressed-tensors", "gptq"):
        code, _, err = cli(capsys, "export", out_dir, "--to", target, "--out", tmp_path / f"x.{target}")
        assert code != 0 and len(err.strip().splitlines()) == 1 and "toy2" in err, err
        assert not (tmp_path / f"x.{target}").exists()


def test_without_it_the_cli_does_not_know_it(tiny_ckpt, tmp_path, capsys):
    code, _, err = cli(capsys, "quantize", tiny_ckpt, "--format", "toy", "--out", tmp_path / "x")
    assert code != 0 and "toy" in err
