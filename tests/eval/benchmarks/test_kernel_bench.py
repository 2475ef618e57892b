"""eval.benchmarks.kernel_bench runs and prints its table (timings themselves are for BENCHMARKS.md, not tests)."""
import pytest
from click.testing import CliRunner

from eval.benchmarks import kernel_bench
from qlite import native


def test_sampling_table():
    r = CliRunner().invoke(kernel_bench.main, ["--sampling", "--calls", "2", "--threads", "1"])
    assert r.exit_code == 0, r.output
    rows = [line.split("|")[1].strip() for line in r.output.splitlines()[2:]]
    assert rows == list(kernel_bench.SAMPLING), r.output


def test_attention_table():
    if native.library() is None:
        pytest.skip("native kernels unavailable here")
    r = CliRunner().invoke(kernel_bench.main, ["--attention", "100", "--calls", "2", "--threads", "1"])
    assert r.exit_code == 0, r.output
    assert [line.split("|")[1].strip() for line in r.output.splitlines()[2:]] == ["bf16", "int8", "int4"]


def test_products_table_one_row():
    if not native.vnni_ready():
        pytest.skip("needs AVX-512 VNNI")
    r = CliRunner().invoke(kernel_bench.main, ["--rows", "1", "--calls", "1", "--threads", "1"])
    assert r.exit_code == 0, r.output
    assert len([line for line in r.output.splitlines() if line.startswith("| ") and "x" in line.split("|")[1]]) >= 3


def test_verify_table(tmp_path):
    from tiny_models import NATIVE_WIDTHS, make_checkpoint
    if native.library() is None:
        pytest.skip("native kernels unavailable here")
    ckpt = make_checkpoint(tmp_path / "tiny", **NATIVE_WIDTHS)
    r = CliRunner().invoke(kernel_bench.main, ["--verify", str(ckpt), "--rows", "4,2", "--calls", "2", "--threads", "1"])
    assert r.exit_code == 0, r.output
    assert [line.split("|")[2].strip() for line in r.output.splitlines()[2:]] == ["1", "2", "4"]
    assert "| fused ms | / one step | modules ms | / one step |" in r.output.splitlines()[0]
    assert r.output.splitlines()[2].split(" | ")[3] == "1.00"  # the fused one-token step, the measure of all


def test_steps_table_and_a_checkpoint_without_a_fused_step(tmp_path, monkeypatch):
    from tiny_models import NATIVE_WIDTHS, make_checkpoint
    ckpt = make_checkpoint(tmp_path / "tiny", **NATIVE_WIDTHS)
    if native.library() is not None:
        r = CliRunner().invoke(kernel_bench.main, ["--steps", str(ckpt), "--calls", "1", "--threads", "1"])
        assert r.exit_code == 0, r.output
        assert r.output.splitlines()[2].startswith("| tiny | "), r.output
    monkeypatch.setenv("QLITE_NATIVE", "0")  # torch's kernels: the layer modules only
    native.library.cache_clear()
    try:
        r = CliRunner().invoke(kernel_bench.main, ["--steps", str(ckpt), "--calls", "1"])
    finally:
        monkeypatch.delenv("QLITE_NATIVE")
        native.library.cache_clear()
    assert r.exit_code == 1 and "no fused step here" in r.output, r.output


def test_against_another_kernel_file(tmp_path, monkeypatch):
    """The current kernel file against itself: every product at every row count the same bits; a file that is
    not one is an error."""
    if native.library() is None:
        pytest.skip("no native kernels here")
    from qlite.formats import Int4, Int8
    monkeypatch.setattr(kernel_bench, "AGAINST", [("integer x", Int4(32), 64, 256), ("bf16 x", Int8(None), 64, 256),
                                                  ("bf16 x", None, 64, 256)])
    monkeypatch.setattr(kernel_bench, "STREAM_BYTES", 100_000)
    source = native.CSRC / native.ISAS[native.isa()][1]
    r = CliRunner().invoke(kernel_bench.main, ["--against", str(source), "--rows", "1,3", "--calls", "2",
                                                "--threads", "1"])
    assert r.exit_code == 0, r.output
    rows = r.output.splitlines()[2:]
    assert [row.split(" | ")[2] for row in rows] == ["1", "3"] * (3 if native.vnni_ready() else 2)
    assert all(row.endswith("| yes |") for row in rows), r.output
    (tmp_path / "abi0.c").write_text("int qlite_gemv_abi(void) { return 0; }\n")
    (tmp_path / "broken.c").write_text("int qlite_gemv_abi(void) { return }\n")
    for name, error in (("abi0.c", "not a kernels file"), ("broken.c", "does not compile")):
        r = CliRunner().invoke(kernel_bench.main, ["--against", str(tmp_path / name)])
        assert r.exit_code == 1 and error in r.output, r.output


def test_peak_table():
    """--peak: the CPU's multiply-add rates on one core and on --threads at once (VNNI and FMA on AVX-512, and
    vpdpwssd as the int8 product issues it; vpmaddubsw alone and in the int4 lanes product's mix, vpmaddwd in the
    int8 one's on AVX2), then the int4 and int8 products' rates at each row count as a share of them."""
    if not native.vnni_ready():
        pytest.skip("no integer-activation kernels")
    r = CliRunner().invoke(kernel_bench.main, ["--peak", "--rows", "1,2", "--calls", "2", "--threads", "1"])
    if native.isa() == "avxvnni":  # no peak_rate.c kernel for its mix: said, not measured against another's
        assert r.exit_code == 1 and "QLITE_NATIVE_ISA=avx2" in r.output, r.output
        return
    assert r.exit_code == 0, r.output
    first = "one core: vpmaddubsw ymm " if native.isa() == "avx2" else "one core: vpdpbusd zmm "
    assert r.output.startswith(first) and "int8 product's at most" in r.output, r.output
    rows = [line.split("|") for line in r.output.splitlines()[3:]]
    assert [row[1].strip() for row in rows] == ["1", "2"] and all(float(row[3]) > 0 for row in rows), r.output
    assert "1 thread at once" in r.output.splitlines()[0]
    assert all(len(row) == 10 and float(row[7]) > 0 for row in rows), r.output  # int8's rate beside int4's


def test_step_floor_table(tmp_path):
    """--peak --steps: a checkpoint's decode steps at 1 and --rows rows against its products at the mixes' bounds;
    the multiply-adds it counts are the layers' weights' (from the config, independently), int4 and int8 apart."""
    import json

    from quantize.convert import convert
    from tiny_models import NATIVE_WIDTHS, make_checkpoint
    if not native.vnni_ready() or native.isa() == "avxvnni":
        pytest.skip("no peak_rate.c mix for this CPU's kernels")
    src = make_checkpoint(tmp_path / "tiny", **NATIVE_WIDTHS)
    ckpt = convert(src, tmp_path / "int4", bits=4, group_size=32, progress=False, report=False).out_dir
    r = CliRunner().invoke(kernel_bench.main, ["--peak", "--steps", str(ckpt), "--rows", "3", "--calls", "2",
                                                "--threads", "1"])
    assert r.exit_code == 0, r.output
    c = json.loads((ckpt / "config.json").read_text())
    H, I, L, V = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    kv = H // c["num_attention_heads"] * c["num_key_value_heads"]
    head4 = c["quantization_config"]["lm_head_bits"] == 4
    int4, int8 = L * (2 * H * H + 2 * H * kv + 3 * H * I) + H * V * head4, H * V * (not head4)
    assert f": {int4 / 1e6:.4g}M int4 and {int8 / 1e6:.4g}M int8 " in r.output.splitlines()[0], r.output
    rows = [line.split(" | ") for line in r.output.splitlines()[3:]]
    assert [row[0] for row in rows] == ["| 1", "| 3"] and rows[0][2] == "1.00", r.output
    assert 0 < float(rows[0][4]) < float(rows[1][4]), r.output  # the floor grows with the rows
    assert all(float(row[3].split()[0]) > 0 for row in rows), r.output  # the products alone, measured
    assert rows[0][5] == "- |" and float(rows[1][5].rstrip(" |")) > 0, r.output
