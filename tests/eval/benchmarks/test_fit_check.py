"""eval/benchmarks/fit_check.py on a tiny checkpoint: a generate run's peak RSS beside qlite's estimate, one row per
context (on a tiny model the runtime is nearly all of both: the ratio means something on real sizes)."""
from click.testing import CliRunner

from eval.benchmarks.fit_check import main
from tiny_models import make_checkpoint


def test_a_row_per_context_with_the_estimate_and_the_measured_peak(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", hidden_size=128, max_position_embeddings=1024)
    result = CliRunner().invoke(main, [str(ckpt), "--ctx", "64,200", "--new-tokens", "4", "--kv-cache", "int8"])
    assert result.exit_code == 0, result.output
    rows = [line.split("|")[1:-1] for line in result.stdout.splitlines()[2:]]
    assert len(rows) == 2
    for context, estimate, measured, ratio in rows:
        assert 0.5 < float(ratio) < 2.0 and int(measured) > 100  # MiB: a Python process with torch
