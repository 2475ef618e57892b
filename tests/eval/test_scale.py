"""eval.scale writes random-weight checkpoints of real Qwen2.5 shapes that qlite loads and runs (the
measurements themselves are for BENCHMARKS.md: too big for CI)."""
import json

import pytest
import torch
from click.testing import CliRunner

from eval.scale import SHAPES, main
from qlite.loader import load_model
from tiny_models import make_checkpoint


@pytest.mark.parametrize("name, billions", [("0.5b", 0.49), ("1.5b", 1.54), ("3b", 3.09), ("7b", 7.62), ("14b", 14.77),
                                            ("32b", 32.76), ("72b", 72.71)])
def test_shapes_have_the_published_parameter_counts(name, billions):
    assert SHAPES[name].parameters() / 1e9 == pytest.approx(billions, abs=0.01)


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
