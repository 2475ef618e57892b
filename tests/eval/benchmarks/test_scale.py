"""eval.benchmarks.scale writes random-weight checkpoints of real Qwen2.5 shapes that qlite loads and runs (the
measurements themselves are for BENCHMARKS.md: too big for CI)."""
import json

import pytest
import torch
from click.testing import CliRunner

from eval.benchmarks.scale import SHAPES, main
from qlite.loader import load_model
from tiny_models import make_checkpoint


@pytest.mark.parametrize("name, billions", [("0.5b", 0.49), ("1.5b", 1.54), ("3b", 3.09), ("7b", 7.62), ("14b", 14.77),
                                            ("32b", 32.76), ("72b", 72.71), ("30b-a3b", 30.53), ("57b-a14b", 57.41)])
def test_shapes_have_the_published_parameter_counts(name, billions):
    assert SHAPES[name].parameters() / 1e9 == pytest.approx(billions, abs=0.01)


@pytest.mark.parametrize("name, active", [("30b-a3b", 3.35), ("57b-a14b", 14.25), ("7b", 7.62)])
def test_a_mixture_reads_its_active_parameters_a_token(name, active):
    assert SHAPES[name].active_parameters() / 1e9 == pytest.approx(active, abs=0.01)


def test_a_one_layer_mixture_loads_and_runs(tmp_path):
    """Qwen3-30B-A3B's widths (128 experts of 768, q/k norms, head_dim 128) as transformers names them."""
    tokenizer = make_checkpoint(tmp_path / "tiny")
    out = tmp_path / "r30"
    r = CliRunner().invoke(main, ["write", "30b-a3b", str(out), "--layers", "1", "--tokenizer-from", str(tokenizer)])
    assert r.exit_code == 0, r.output
    model = load_model(out, dtype="bfloat16")
    assert sum(p.numel() for p in model.parameters()) == SHAPES["30b-a3b"].parameters(1)
    assert len(model.model.layers[0].mlp.experts) == 128
    logits = model(torch.tensor([[1, 2, 3]]))
    assert logits.shape == (1, 3, 151936) and torch.isfinite(logits).all()


def test_a_one_layer_0_5b_checkpoint_loads_and_runs(tmp_path):
    tokenizer = make_checkpoint(tmp_path / "tiny")
    out = tmp_path / "r05"
    r = CliRunner().invoke(main, ["write", "0.5b", str(out), "--layers", "1", "--tokenizer-from", str(tokenizer)])
    assert r.exit_code == 0, r.output
    config = json.loads((out / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (896, 1, 151936)
    assert (out / "tokenizer.json").exists() and not (tmp_path / "r05.partial").exists()
    model = load_model(out, dtype="bfloat16")
    assert sum(p.numel() for p in model.parameters()) == SHAPES["0.5b"].parameters(1)
    logits = model(torch.tensor([[1, 2, 3]]))
    assert logits.shape == (1, 3, 151936) and torch.isfinite(logits).all()
    again = CliRunner().invoke(main, ["write", "0.5b", str(out), "--layers", "1", "--tokenizer-from", str(tokenizer)])
    assert again.exit_code != 0 and "already exists" in again.output


def test_measure_smoke_run_on_a_one_layer_0_5b_shape(tmp_path):
    """The scale table's pipeline end to end: the checkpoint written once, quantized in a child (time, its own
    peak RSS, the output's size), the result loaded and timed."""
    tokenizer = make_checkpoint(tmp_path / "tiny")
    args = ["measure", "0.5b", "--layers", "1", "--dir", str(tmp_path / "work"), "--recipes", "rtn", "--bench",
            "--prompt-tokens", "8", "--new-tokens", "2", "--threads", "1", "--tokenizer-from", str(tokenizer),
            "--markdown", str(tmp_path / "scale.md")]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    quantized, timed = ([cell.strip() for cell in line.strip("|").split("|")]
                        for line in r.output.splitlines() if line.startswith("| 0.5b"))
    assert quantized[2] == "rtn" and float(quantized[3]) > 0 and 300 < float(quantized[5]) < 4000  # peak MiB
    assert 100 < float(quantized[6]) < float(quantized[5])  # peak anonymous MiB: torch's own, under the RSS
    assert 0 < float(quantized[7]) < 2 * SHAPES["0.5b"].parameters(1) / 2**20  # quantized: under the bf16 size
    assert timed[1] == "qlite rtn" and float(timed[3]) > 0 and float(timed[4]) > 0  # prefill, decode tok/s
    assert (tmp_path / "scale.md").read_text().startswith("| shape |")
    bad = CliRunner().invoke(main, ["measure", "0.5b", "--recipes", "rtn,awq", "--dir", str(tmp_path / "work")])
    assert bad.exit_code != 0 and "--recipes: unknown awq" in bad.output


def test_measure_runs_llama_cpps_converter_and_quantizer_on_the_same_checkpoint(tmp_path):
    """--llama-cpp: the tree's convert_hf_to_gguf.py gets the checkpoint and writes the f16 file, its
    llama-quantize makes each type from that, each timed as a row; the f16 file is gone after. A stand-in
    tree (scripts that check their arguments and write files) stands for llama.cpp here."""
    tree = tmp_path / "llama"
    (tree / "build/bin").mkdir(parents=True)
    (tree / "convert_hf_to_gguf.py").write_text(
        "import sys, pathlib\n"
        "src, outtype, out = sys.argv[1], sys.argv[sys.argv.index('--outtype') + 1], sys.argv[sys.argv.index('--outfile') + 1]\n"
        "assert outtype == 'f16' and (pathlib.Path(src) / 'config.json').exists()\n"
        "pathlib.Path(out).write_bytes(b'f16' * 1000)\n")
    quantizer = tree / "build/bin/llama-quantize"
    quantizer.write_text("#!/bin/sh\n[ \"$3\" = Q4_0 ] || [ \"$3\" = Q8_0 ] || exit 1\n"
                         "test -f \"$1\" && head -c 1000 \"$1\" > \"$2\"\n")
    quantizer.chmod(0o755)
    tokenizer = make_checkpoint(tmp_path / "tiny")
    args = ["measure", "0.5b", "--layers", "1", "--dir", str(tmp_path / "work"), "--recipes", "rtn",
            "--llama-cpp", str(tree), "--tokenizer-from", str(tokenizer)]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    rows = {cells[2]: cells for cells in ([c.strip() for c in line.strip("|").split("|")]
                                          for line in r.output.splitlines() if line.startswith("| 0.5b"))}
    assert set(rows) == {"rtn", "llama.cpp convert f16", "llama.cpp Q4_0", "llama.cpp Q8_0"}
    # seconds (the stand-ins may take under 0.05 s: "0.0") and peak MiB, each a number; qlite's a real peak
    assert all(float(cells[3]) >= 0 and float(cells[5]) >= 0 for cells in rows.values())
    assert float(rows["rtn"][3]) > 0 and float(rows["rtn"][5]) > 100
    work = tmp_path / "work"
    assert (work / "r0.5b-1l-q4_0.gguf").stat().st_size == 1000 and not (work / "r0.5b-1l-f16.gguf").exists()
    broken = CliRunner().invoke(main, [*args[:-4], "--llama-cpp", str(tmp_path / "work")])
    assert broken.exit_code != 0 and "needs convert_hf_to_gguf.py and build/bin/llama-quantize" in broken.output


def test_plot_draws_the_cost_table(tmp_path):
    pytest.importorskip("matplotlib")
    from eval.benchmarks.scale import plot
    rows = [{"recipe": r, "params": p, "seconds": s, "peak": 2**30, "error": ""}
            for r in ("rtn", "llama.cpp Q4_0") for p, s in ((5e8, 20.0), (7.6e9, 300.0))]
    plot(rows + [{**rows[0], "error": "died"}], tmp_path / "cost.png")
    assert (tmp_path / "cost.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
