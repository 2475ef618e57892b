"""eval.kernel_bench runs and prints its table (timings themselves are for BENCHMARKS.md, not tests)."""
import pytest
from click.testing import CliRunner

from eval import kernel_bench
from qlite import native


def test_sampling_table():
    r = CliRunner().invoke(kernel_bench.main, ["--sampling", "--calls", "2", "--threads", "1"])
    assert r.exit_code == 0, r.output
    rows = [line.split("|")[1].strip() for line in r.output.splitlines()[2:]]
    assert rows == list(kernel_bench.SAMPLING), r.output


def test_products_table_one_row():
    if not native.vnni_ready():
        pytest.skip("needs AVX-512 VNNI")
    r = CliRunner().invoke(kernel_bench.main, ["--rows", "1", "--calls", "1", "--threads", "1"])
    assert r.exit_code == 0, r.output
    assert len([line for line in r.output.splitlines() if line.startswith("| ") and "x" in line.split("|")[1]]) >= 3
