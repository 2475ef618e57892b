"""The demo model quantized to int8 and int4-g128 (RTN) still writes a working prime function."""
import subprocess
import sys

import pytest

from tiny_models import PRIME_PROMPT, check_prime_code

pytestmark = pytest.mark.demo


@pytest.mark.parametrize("which", ["demo_int8", "demo_int4"])
def test_quantized_demo_writes_a_working_prime_function(which, request):
    model_dir = request.getfixturevalue(which)
    r = subprocess.run([sys.executable, "-m", "qlite", "generate", "-m", str(model_dir), "-p", PRIME_PROMPT,
                        "--temperature", "0", "--max-new-tokens", "400"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    print(f"\n{which} greedy answer:\n{r.stdout}")
    check_prime_code(r.stdout)


def test_quantize_peak_memory_stays_under_1_5_gb(demo_dir, tmp_path):
    """Run in a fresh process so the figure is the converter's alone (VmHWM: includes mapped pages);
    without the report's measurement, which loads the quantized model (docs/quantize.md: its own peak)."""
    code = ("import sys; from quantize.convert import convert; "
            f"s = convert({str(demo_dir)!r}, {str(tmp_path / 'q')!r}, bits=4, group_size=128, progress=False, "
            "report=False); "
            "print(s.peak_rss_bytes, s.peak_anon_bytes)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    peak, anon = map(int, r.stdout.split())
    print(f"\nquantize demo -> int4-g128: peak RSS {peak / 2**20:.0f} MiB, peak anonymous {anon / 2**20:.0f} MiB")
    assert peak < 1.5e9


def test_target_bpw_keeps_the_demo_within_its_budget(demo_dir, tmp_path):
    """Q4_0's size (5.37 bits per parameter); a small calibration (the budget does not depend on it)."""
    import math

    from qlite.checkpoint import CheckpointDir
    from quantize.budget import budget_convert

    s = budget_convert(demo_dir, tmp_path / "q", target_bpw=5.37, windows=2, seqlen=64, samples=1, progress=False,
                       report=False)
    params = sum(math.prod(i.shape) for i in CheckpointDir(demo_dir).tensors.values())
    written = 8 * sum(i.nbytes for i in CheckpointDir(s.out_dir).tensors.values()) / params
    print(f"\n{s}")
    assert 5.3 < written <= 5.37 and s.bits_per_parameter == pytest.approx(written)
