"""One pass over the source: the report's reference rides the sensitivities' forward or the calibration
instead of a pass of its own, and nothing it rides changes: checkpoints and reports are bit for bit
what separate passes give (the report against a reference made by its own pass, the calibrated weights
and sensitivities without a rider). Each layer is read as often as the module docstring says."""
import json
from collections import Counter

import pytest
import torch

import quantize.sensitivity
import quantize.source_pass
from qlite.checkpoint import CheckpointDir
from qlite.formats import format_named
from qlite.info import REPORT_NAME
from quantize.budget import budget_convert
from quantize.calibrate import calibrated_convert
from quantize.convert import convert
from quantize.report import measure, reference
from quantize.sensitivity import calibration_windows, sensitivities
from quantize.source_pass import source_pass
from tiny_models import NATIVE_WIDTHS, make_checkpoint

CALIB = dict(nsamples=4, seqlen=64)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("pass") / "ckpt", seed=3, **{**NATIVE_WIDTHS, "num_hidden_layers": 3})


@pytest.fixture
def reads(monkeypatch):
    """Layer index -> times a float layer was read from the source."""
    counts = Counter()
    for module in (quantize.source_pass, quantize.sensitivity):
        real = module.float_layer

        def counting(ckpt, cfg, i, real=real, **kwargs):
            counts[i] += 1
            return real(ckpt, cfg, i, **kwargs)

        monkeypatch.setattr(module, "float_layer", counting)
    return counts


def fidelity(out) -> dict:
    report = json.loads((out / REPORT_NAME).read_text())["fidelity"]
    report.pop("seconds")
    return report


def tensors(out) -> dict[str, torch.Tensor]:
    ckpt = CheckpointDir(out)
    return {name: ckpt.read(name) for name in ckpt.tensors}


def same_tensors(a, b) -> bool:
    ta, tb = tensors(a), tensors(b)
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def own_pass_fidelity(src, out) -> dict:
    """The report as a pass of its own over the source measures it (the multi-pass way)."""
    measured = measure(CheckpointDir(src), out)
    measured.pop("seconds")
    return measured


def test_rtn_reads_each_layer_once_for_its_report(src, tmp_path, reads):
    convert(src, tmp_path / "q", bits=4, group_size=32, progress=False)
    assert dict(reads) == {0: 1, 1: 1, 2: 1}


def test_gptq_report_rides_the_calibration_pass_and_changes_nothing(src, tmp_path, reads):
    with_report = calibrated_convert(src, tmp_path / "r", bits=4, group_size=32, progress=False, **CALIB).out_dir
    assert dict(reads) == {0: 1, 1: 1, 2: 1}  # was 2: the calibration's, then the report's own
    alone = calibrated_convert(src, tmp_path / "n", bits=4, group_size=32, progress=False, report=False, **CALIB).out_dir
    assert same_tensors(with_report, alone)
    assert fidelity(with_report) == own_pass_fidelity(src, with_report)


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_target_bpw_report_rides_the_sensitivities_forward(src, tmp_path, reads, method):
    calibration = dict(calib="builtin", act_order=False, damp=0.01, **CALIB) if method == "gptq" else None
    out = budget_convert(src, tmp_path / "q", target_bpw=6.0, progress=False, method=method, windows=2, seqlen=32,
                         samples=2, calibration=calibration).out_dir
    # forward (with the reference) and backward; GPTQ's own pass after the mix is chosen
    assert dict(reads) == {i: 3 if method == "gptq" else 2 for i in range(3)}
    assert fidelity(out) == own_pass_fidelity(src, out)
    reads.clear()
    again = budget_convert(src, tmp_path / "n", target_bpw=6.0, progress=False, method=method, windows=2, seqlen=32,
                           samples=2, calibration=calibration, report=False).out_dir
    assert same_tensors(out, again)  # the same mix, so the same sensitivities, without the rider


def test_sensitivities_are_the_same_with_a_rider(src):
    ckpt = CheckpointDir(src)
    ids = calibration_windows(ckpt, 2, 32)
    candidates = {"model.layers.1.mlp.down_proj": [format_named("int4-g32"), format_named("int8")],
                  "lm_head": [format_named("int8")]}
    plain = sensitivities(ckpt, candidates, ids, samples=2, progress=False)
    ref = reference(ckpt)
    ridden = sensitivities(ckpt, candidates, ids, samples=2, progress=False, riders=(ref.windows,))
    assert plain == ridden
    own = reference(ckpt)
    source_pass(ckpt, [own.windows], progress=False)
    assert torch.equal(ref.finish(ckpt).normed, own.finish(ckpt).normed)
