"""--target-bpw: the budget never exceeded (counted from the written
files), the mix runs, and bad budgets are one line that writes nothing. --target-kld: what it keeps
was measured within the target, and is the smallest of its trials that was."""
import json
import math
import shutil

import pytest
import torch

from qlite.checkpoint import CheckpointDir
from qlite.cli import main
from qlite.errors import QliteError
from qlite.loader import load_model
from qlite.info import REPORT_NAME
from quantize.budget import Mixer, budget_convert, kld_convert
from tiny_models import NATIVE_WIDTHS, make_checkpoint


@pytest.fixture(scope="module", params=["untied", "tied"])
def src(request, tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("budget") / "ckpt", seed=5,
                           **dict(NATIVE_WIDTHS, tie_word_embeddings=request.param == "tied"))


def written_bits_per_parameter(src, out) -> float:
    """From the files: every stored tensor's bytes x 8 over the source's parameters."""
    params = sum(math.prod(i.shape) for i in CheckpointDir(src).tensors.values())
    return 8 * sum(i.nbytes for i in CheckpointDir(out).tensors.values()) / params


def test_budgets_are_never_exceeded_and_more_budget_buys_fidelity(src, tmp_path):
    predicted = []
    for bpw in (4.5, 5.0, 6.0, 8.5, 40.0):
        s = budget_convert(src, tmp_path / f"b{bpw}", target_bpw=bpw, windows=4, seqlen=64, samples=2,
                           progress=False, report=False)
        assert s.bits_per_parameter == pytest.approx(written_bits_per_parameter(src, s.out_dir))
        assert written_bits_per_parameter(src, s.out_dir) <= bpw
        assert s.bits_per_parameter > 0.9 * bpw or bpw == 40.0  # the budget is used, not left idle
        q = json.loads((s.out_dir / "config.json").read_text())["quantization_config"]
        assert q["format_version"] == 3 and q["target_bpw"] == bpw and len(q["module_formats"]) == 14
        assert q["sensitivity"] == {"windows": 4, "seqlen": 64, "samples": 2, "data": "builtin"}
        predicted.append(q["predicted_kld"])
    assert predicted == sorted(predicted, reverse=True) and predicted[0] > 10 * predicted[-2]
    assert predicted[-1] == 0 and s.bits_per_parameter == 32  # room for all: the float32 source's tensors as they are


def test_a_mixed_checkpoint_runs_close_to_its_source(src, tmp_path):
    """With the default calibration: with 4 x 64 tokens and 2 samples the estimates are noisy enough that
    one more format to choose from (int4-g32) made the 6-bit mix 2x further off (0.076 against 0.037);
    with the defaults the two choice sets land within 10% of each other."""
    s = budget_convert(src, tmp_path / "mix", target_bpw=6.0, progress=False, report=False)
    formats = set(json.loads((s.out_dir / "config.json").read_text())["quantization_config"]["module_formats"].values())
    assert len(formats) >= 2  # a mix, not one format
    ids = torch.arange(40)[None] % 300
    with torch.inference_mode():
        ref = load_model(src, dtype="float32")(ids)
        got = load_model(s.out_dir, dtype="float32")(ids)
    kld = (torch.log_softmax(ref, -1).exp() * (torch.log_softmax(ref, -1) - torch.log_softmax(got, -1))).sum(-1)
    assert kld.mean() < 0.05


@pytest.mark.parametrize("method", ["gptq", "act-rtn"])
def test_calibrated_methods_quantize_the_same_mix(src, tmp_path, method):
    common = dict(target_bpw=5.0, windows=4, seqlen=64, samples=2, progress=False, report=False)
    rtn = budget_convert(src, tmp_path / "rtn", **common)
    calibrated = budget_convert(src, tmp_path / method, method=method, calibration=dict(
        calib="builtin", nsamples=4, seqlen=64, act_order=False, damp=0.01), **common)
    q_rtn, q = (json.loads((s.out_dir / "config.json").read_text())["quantization_config"] for s in (rtn, calibrated))
    assert q["method"] == method and q["nsamples"] == 4 and q["sensitivity"]["seqlen"] == 64
    assert q["module_formats"] == q_rtn["module_formats"] and calibrated.bytes_after == rtn.bytes_after
    int4 = [m for m, f in q_rtn["module_formats"].items() if f and f.startswith("int4")]
    assert int4
    a, b = CheckpointDir(rtn.out_dir), CheckpointDir(calibrated.out_dir)
    assert any(not torch.equal(a.read(f"{m}.qweight"), b.read(f"{m}.qweight")) for m in int4)  # the method's codes


@pytest.mark.parametrize("value, message", [
    ("1", "--target-bpw 1: below the smallest mix for"),
    ("-3", "Invalid value for '--target-bpw': -3 is not > 0"),
    ("abc", "Invalid value for '--target-bpw': 'abc' is not a number"),
    ("nan", "Invalid value for '--target-bpw': nan is not > 0"),
])
def test_bad_budgets_are_one_line_and_write_nothing(src, tmp_path, capsys, value, message):
    code = main(["quantize", str(src), "--out", str(tmp_path / "q"), "--target-bpw", value])
    err = capsys.readouterr().err.strip()
    assert code != 0 and message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "q").exists() and list(tmp_path.iterdir()) == []


def test_target_bpw_refuses_flags_that_choose_formats(src, tmp_path, capsys):
    code = main(["quantize", str(src), "--out", str(tmp_path / "q"), "--target-bpw", "5", "--bits", "8",
                 "--symmetric", "--act-order"])
    err = capsys.readouterr().err.strip()
    assert code != 0 and err == "error: --target-bpw chooses every tensor's format; drop --bits, --symmetric, --act-order"
    with pytest.raises(QliteError, match="must be a positive number"):
        budget_convert(src, tmp_path / "q", target_bpw=float("inf"))
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("kld") / "ckpt", seed=5, **NATIVE_WIDTHS)


def test_target_kld_keeps_the_smallest_trial_within_the_target(untied, tmp_path, capsys):
    s = kld_convert(untied, tmp_path / "k", target_kld=0.05, windows=4, seqlen=64, samples=2, trials=4)
    report = json.loads((s.out_dir / REPORT_NAME).read_text())
    assert max(t["kld_mean"] for t in report["fidelity"]["texts"].values()) <= 0.05
    assert json.loads((s.out_dir / "config.json").read_text())["quantization_config"]["target_kld"] == 0.05
    trials = [line.split() for line in capsys.readouterr().err.splitlines() if line.startswith("trial ")]
    passed = [float(t[2]) for t in trials if float(t[7]) <= 0.05]  # "trial 1: 5.203 bits per parameter, KLD 0.10608 ..."
    assert 2 <= len(trials) <= 4 and s.bits_per_parameter == pytest.approx(min(passed), abs=1e-3)
    assert s.bits_per_parameter == pytest.approx(written_bits_per_parameter(untied, s.out_dir))
    assert [p.name for p in tmp_path.iterdir()] == ["k"] and not list(s.out_dir.glob("trial*"))


def test_a_loose_target_kld_takes_the_smallest_mix_and_one_out_of_reach_writes_nothing(untied, tmp_path, capsys):
    s = kld_convert(untied, None, target_kld=10, windows=4, seqlen=64, samples=2, progress=False)
    assert s.out_dir == untied.parent / "ckpt-kld10"  # the default --out names the target
    out = shutil.move(s.out_dir, tmp_path / "k")
    assert s.bits_per_parameter == pytest.approx(Mixer(CheckpointDir(untied), (), least_bits=4).smallest_bits())  # 4 bits and up
    assert "predicted_kld" in json.loads((out / "config.json").read_text())["quantization_config"]
    code = main(["quantize", str(untied), "--out", str(tmp_path / "q"), "--target-kld", "1e-9"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err[-1].startswith("error: --target-kld 1e-09: no mix of") and "the closest: mean KLD" in err[-1]
    assert [p.name for p in tmp_path.iterdir()] == ["k"]


@pytest.mark.parametrize("flags, message", [
    (["--target-kld", "0.1", "--no-report"], "--target-kld chooses every tensor's format; drop --no-report"),
    (["--target-kld", "0.1", "--method", "gptq"], "--target-kld chooses every tensor's format; drop --method"),
    (["--target-bpw", "5", "--target-kld", "0.1"], "--target-bpw chooses every tensor's format; drop --target-kld"),
    (["--target-kld", "-1"], "Invalid value for '--target-kld': -1 is not > 0"),
])
def test_target_kld_flag_errors(untied, tmp_path, capsys, flags, message):
    assert main(["quantize", str(untied), "--out", str(tmp_path / "q"), *flags]) != 0
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and list(tmp_path.iterdir()) == []


SLOW_SMALL_GROUPS = {"int4-g128": 1.0, "int4k-g64": 1.5, "int4k-g32": 1.8, "int8": 1.6, "int8-g32": 1.9, None: 3.0,
                     "int3k-g32": 2.7, "int3k-g16": 3.4, "int2k-g32": 2.9, "int2k-g16": 3.4}


def test_no_slower_than_prices_decode_time_into_the_mix(untied, monkeypatch):
    """With costs that favour the bigger formats, the unconstrained mix decodes slower than int4-g128
    would (estimated); with the time budget the mix meets it, within the same bytes, at some KLD."""
    monkeypatch.setattr("quantize.budget.decode_ps", lambda fmt: SLOW_SMALL_GROUPS[fmt and fmt.name])
    mixer = Mixer(CheckpointDir(untied), ())
    mixer.costs = {u: [0.0 if f is None else 1.0 / b for f, b in o] for u, o in mixer.options.items()}
    reference = mixer.reference_seconds("int4-g128")
    budget = mixer.bytes_for(6.0)
    free, free_kld = mixer.mix(budget)
    timed, timed_kld = mixer.mix(budget, reference)
    assert mixer.decode_seconds(free) > reference >= mixer.decode_seconds(timed)
    assert timed_kld >= free_kld and timed_kld == pytest.approx(mixer.kld(timed))
    used = lambda formats: sum(b for u, o in mixer.options.items() for f, b in o if f == formats[mixer.modules[u][0]])
    assert used(timed) <= budget and used(free) <= budget
    fastest = sum(min(t) for t in mixer.seconds.values())
    assert mixer.mix(budget, 0.99 * fastest) is None
    with pytest.raises(QliteError, match="--no-slower-than nf4-b64: choose one of int2k-g32, .*int4-g128"):
        mixer.reference_seconds("nf4-b64")


def test_no_slower_than_writes_a_mix_within_both_budgets(untied, tmp_path, capsys):
    s = budget_convert(untied, tmp_path / "t", target_bpw=6.0, windows=4, seqlen=64, samples=2, progress=False,
                       report=False, no_slower_than="int4-g128")
    q = json.loads((s.out_dir / "config.json").read_text())["quantization_config"]
    assert q["no_slower_than"] == "int4-g128" and q["predicted_decode_ms"] <= q["reference_decode_ms"]
    assert written_bits_per_parameter(untied, s.out_dir) <= 6.0
    for flags, message in ((["--no-slower-than", "int4-g128"], "--no-slower-than: goes with --target-bpw"),
                           (["--target-bpw", "6", "--no-slower-than", "int4-g7"], "--no-slower-than int4-g7: choose one of")):
        assert main(["quantize", str(untied), "--out", str(tmp_path / "q"), *flags]) != 0
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1 and not (tmp_path / "q").exists()


def test_an_expert_costs_decode_time_by_the_share_of_tokens_that_read_it(tmp_path):
    """A token reads k of a sparse layer's experts: an expert's weights count k / experts of theirs in the
    decode-time estimate (counted whole, int8 attention looked as cheap as int8 experts and the q4 preset
    put every attention projection of Qwen3-30B-A3B's shape in int8, reading 1.3x a layer's int4 bytes)."""
    from tiny_models import MOE
    src = CheckpointDir(make_checkpoint(tmp_path / "moe", model_type="qwen3_moe", **MOE["qwen3_moe"]))
    mixer = Mixer(src, ())
    share = MOE["qwen3_moe"]["num_experts_per_tok"] / MOE["qwen3_moe"]["num_experts"]
    expert, attn = "model.layers.0.mlp.experts.0.down_proj", "model.layers.0.self_attn.o_proj"
    per_weight = lambda u: mixer.seconds[u][0] / math.prod(src.tensors[f"{mixer.modules[u][0]}.weight"].shape)  # noqa: E731
    assert per_weight(expert) == pytest.approx(share * per_weight(attn))


def test_sub_4_bit_formats_join_the_mix_where_the_budget_needs_them(src, tmp_path):
    """int3k / int2k are candidates (a 4-bit preset's Mixer, least_bits=4, has none): a 3-bit budget's mix
    takes them and stays within its bytes; an 8.5-bit one, with room, leaves them out."""
    mixer = Mixer(CheckpointDir(src), ())
    low = lambda formats: {f.name for f in formats if f is not None and f.bits < 4}  # noqa: E731
    assert low(f for o in mixer.options.values() for f, _ in o) == {"int3k-g16", "int3k-g32", "int2k-g16", "int2k-g32"}
    assert not low(f for o in Mixer(CheckpointDir(src), (), least_bits=4).options.values() for f, _ in o)
    for bpw, takes_low in ((3.0, True), (8.5, False)):
        s = budget_convert(src, tmp_path / f"b{bpw}", target_bpw=bpw, windows=4, seqlen=64, samples=2, progress=False,
                           report=False)
        formats = json.loads((s.out_dir / "config.json").read_text())["quantization_config"]["module_formats"]
        assert bool({f for f in formats.values() if f.startswith(("int3k", "int2k"))}) == takes_low, formats
        assert written_bits_per_parameter(src, s.out_dir) <= bpw


def test_the_cli_names_every_format_target_bpw_chooses_among():
    """--target-bpw's help keeps its list literal (naming them from qlite.formats would load torch for
    `qlite --help`): it names each budget candidate, and no other format."""
    import re
    from qlite.cli import quantize
    from qlite.formats import budget_candidates

    help_text = next(p for p in quantize.params if p.name == "target_bpw").help
    named = set(re.findall(r"\bint\d+k?(?:-g\d+)?\b", help_text))
    assert named == {f.name for f in budget_candidates()}
