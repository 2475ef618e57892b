from click.testing import CliRunner

from eval.benchmarks.prefill_bench import main


def test_prints_each_lengths_median_and_spread(tiny_ckpt):
    r = CliRunner().invoke(main, [str(tiny_ckpt), "8", "16", "--repeats", "2"])
    assert r.exit_code == 0, r.output
    lines = r.output.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["T=8", "T=16"] and all("tok/s" in line for line in lines)
