"""CI's eval step: the demo model's int8 and int4-g128 (RTN) against its 16-bit baseline on a fixed
slice of the built-in text, with regression bars."""
import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.demo

CTX, CHUNKS = 256, 2
# Regression bars on this slice (2 chunks of 256 tokens per source), set from the values measured
# (mean KLD / top-1 on a Zen 3 machine, AVX2 kernels: int8 code 0.00187 / 97.06%, prose 0.00458 / 96.47%;
# int4-g128 code 0.0746 / 86.86%, prose 0.2389 / 76.86%) plus about 25-30% on KLD and 1-2 points on top-1.
# (6 chunks of 512 tokens until 2026-12-03, measured on AVX-512 kernels: int8 code 0.00198 / 97.49%, prose
# 0.00471 / 96.22%; int4-g128 code 0.0752 / 87.51%, prose 0.2214 / 77.95%. A sixth of the tokens, so that
# CI fits its 30 minutes on an AVX2-only machine, where the 6-chunk eval alone took 6 of them.) The issue's
# starting bars were int8 KLD <= 0.006, top-1 >= 95%; int4-g128 KLD <= 0.35, top-1 >= 70%.
BARS = {  # (model dir, data): (max mean KLD, min top-1)
    ("int8", "code"): (0.0025, 0.955),
    ("int8", "prose"): (0.006, 0.95),
    ("int4-g128", "code"): (0.095, 0.85),
    ("int4-g128", "prose"): (0.30, 0.745),
}


def test_demo_eval_meets_the_bars(demo_dir, demo_int8, demo_int4, tmp_path):
    report = tmp_path / "eval.json"
    r = subprocess.run([sys.executable, "-m", "qlite", "eval", str(demo_dir), str(demo_int8), str(demo_int4),
                        "--baseline", str(demo_dir), "--ctx", str(CTX), "--max-chunks", str(CHUNKS),
                        "--json", str(report)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    print("\n" + r.stdout)
    rows = {(row["model"], row["data"]): row["metrics"] for row in json.loads(report.read_text())["rows"]}
    misses = []
    for (model, data), (max_kld, min_top1) in BARS.items():
        m = rows[(model, data)]
        if m["kld_mean"] > max_kld or m["top1"] < min_top1:
            misses.append(f"{model}/{data}: KLD {m['kld_mean']:.5f} (bar {max_kld}), top-1 {m['top1']:.4f} (bar {min_top1})")
    assert not misses, "; ".join(misses)
    base = rows[(demo_dir.name, "code")]
    assert base["kld_mean"] < rows[("int8", "code")]["kld_mean"]  # bf16 activations alone cost less than int8


# Code tasks on a fixed slice of the suite (eval/task_sources.py: every 39th of its 310 tasks, 8), greedy, answers
# of at most 256 tokens, int4-g128 RTN against the baseline; the whole suite is a benchmark (eval/benchmarks/functional.py,
# BENCHMARKS.md). Measured (Zen 4, AVX-512 kernels, 69 s): the baseline passes 4 of these 8, int4 +0 / -1, KLD on
# the baseline's answers 0.0083. The bar leaves 1 more task of room. (Every 9th built-in task until 2026-12-06:
# those tasks became the `chat` calibration data.)
SLICE_STRIDE = 39
MAX_NET_LOSSES = 2


def test_demo_int4_still_writes_working_code(demo_dir, demo_int4, tmp_path):
    from eval.code_tasks import dump_tasks
    from eval.task_sources import load_suite

    suite = load_suite()
    assert len(suite) >= 300
    subset = tmp_path / "tasks.jsonl"
    dump_tasks(suite[::SLICE_STRIDE], subset)
    report = tmp_path / "code.json"
    r = subprocess.run([sys.executable, "-m", "qlite", "eval", str(demo_int4), "--baseline", str(demo_dir),
                        "--data", "none", "--tasks", str(subset), "--max-new-tokens", "256", "--json", str(report)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    print("\n" + r.stdout)
    base, int4 = json.loads(report.read_text())["code_tasks"]
    assert base["tasks"] == int4["tasks"] == len(suite[::SLICE_STRIDE])
    assert base["passed"] >= 1  # the 16-bit model still writes working code
    assert int4["losses"] - int4["wins"] <= MAX_NET_LOSSES, int4
    assert 0 < int4["answer_fidelity"]["kld_mean"] < 1.0  # read on the baseline's answers, all of them
    assert int4["answer_fidelity"]["tokens"] == base["tokens"]
