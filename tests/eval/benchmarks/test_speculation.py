"""eval.benchmarks.speculation's table on a tiny model: every set runs, speculative output is plain greedy's."""
import json

import pytest
from click.testing import CliRunner

from eval.benchmarks.speculation import EDITS_FILE, main, prompt_sets
from qlite import native
from tiny_models import NATIVE_WIDTHS, make_checkpoint


def test_the_code_edit_set_has_twenty_edits_of_each_kind_named():
    edits = [json.loads(line) for line in EDITS_FILE.read_text().splitlines()]
    assert len(edits) >= 20
    assert {e["kind"] for e in edits} == {"rename", "types", "docstring", "bugfix", "refactor"}
    assert all(e["code"].endswith("\n") and e["instruction"] for e in edits)
    sets = prompt_sets(["code-edit", "open", "prose"], None)
    assert len(sets["code-edit"]) == len(edits) and len(sets["open"]) >= 20 and sets["prose"]


@pytest.mark.skipif(native.library() is None, reason="native kernels unavailable here")
def test_the_table_on_a_tiny_model(tmp_path):
    from quantize.convert import convert
    src = make_checkpoint(tmp_path / "bf16", **{**NATIVE_WIDTHS, "max_position_embeddings": 4096})  # byte-level prompts
    q = convert(src, tmp_path / "int4", bits=4, group_size=64, progress=False, report=False).out_dir
    r = CliRunner().invoke(main, [str(q), "--limit", "2", "--new-tokens", "12", "--threads", "1",
                                  "--markdown", str(tmp_path / "t.md")])
    assert r.exit_code == 0, r.output
    rows = [line for line in r.output.splitlines() if line.startswith(("| code-edit", "| open", "| prose"))]
    assert len(rows) == 3 and all(row.rstrip(" |").endswith("2/2") for row in rows)
    assert (tmp_path / "t.md").read_text().startswith("| set |")


@pytest.mark.skipif(native.library() is None, reason="native kernels unavailable here")
def test_the_table_with_a_draft_model_and_a_baseline(tmp_path):
    """Quantized self-speculation's row: the int8 model, its int4 copy drafting, the int4 one's plain speed."""
    from quantize.convert import convert
    src = make_checkpoint(tmp_path / "bf16", **{**NATIVE_WIDTHS, "max_position_embeddings": 4096})
    int8 = convert(src, tmp_path / "int8", bits=8, progress=False, report=False).out_dir
    int4 = convert(src, tmp_path / "int4", bits=4, group_size=64, progress=False, report=False).out_dir
    r = CliRunner().invoke(main, [str(int8), "--sets", "code-edit", "--limit", "2", "--new-tokens", "12",
                                  "--threads", "1", "--speculate", str(int4), "--baseline", str(int4)])
    assert r.exit_code == 0, r.output
    header = next(line for line in r.output.splitlines() if line.startswith("| set"))
    assert "qlite draft tok/s" in header and "int4 plain tok/s | qlite draft / it |" in header
    row = next(line for line in r.output.splitlines() if line.startswith("| code-edit"))
    assert "| 2/2 |" in row and len(row.split("|")) == len(header.split("|"))
