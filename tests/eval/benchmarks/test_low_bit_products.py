"""eval.benchmarks.low_bit_products: every format's product on every shape, timed against int4-g128's (tiny shapes here)."""
import pytest

from qlite import native


def test_every_format_and_shape_gets_a_row(monkeypatch, capsys):
    if not native.vnni_ready():
        pytest.skip("no integer-activation kernels here")
    import eval.benchmarks.low_bit_products as bench
    monkeypatch.setattr(bench, "SHAPES", [(64, 256), (32, 384)])
    monkeypatch.setattr(bench, "COPY_BYTES", 1e5)
    bench.main(2)
    rows = [line for line in capsys.readouterr().out.splitlines() if line[2:3].isdigit()]  # "| N x K | format | ..."
    assert len(rows) == 2 * len(bench.names())
    assert any(" lanes | " in row for row in rows) == native.vnni_ready()
    assert all(row.split(" | ")[-1].rstrip(" |") == "1.00" for row in rows if "int4-g128" in row)
