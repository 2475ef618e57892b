"""The backend seam: chosen once at load, by name; `--kernel reference` is reference all the way down."""
import inspect

import pytest
import torch

from qlite import native
from qlite.backends import BACKENDS, NativeOps, use_backend
from qlite.errors import QliteError
from qlite.decode import generate_tokens
from qlite.generate import SamplingParams
from qlite.loader import load_model
from qlite.decoder.linear import Linear
from qlite.decoder.ops import TorchOps
from qlite.qlinear import QuantLinear
from tiny_models import NATIVE_WIDTHS, make_checkpoint


class NativeCalled(Exception):
    pass


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from quantize.convert import convert
    src = make_checkpoint(tmp_path_factory.mktemp("backends") / "bf16", **NATIVE_WIDTHS)
    return {"bf16": src, "int8": convert(src, src.parent / "int8", bits=8, group_size=None, progress=False).out_dir,
            "int4": convert(src, src.parent / "int4", bits=4, group_size=64, progress=False).out_dir}


def forbid_native(monkeypatch):
    """Every function of qlite.native raises: any native call at load or in a forward fails the test."""
    def refuse(*args, **kwargs):
        raise NativeCalled
    for name, fn in inspect.getmembers(native, inspect.isfunction):
        if fn.__module__ == native.__name__:
            monkeypatch.setattr(native, name, refuse)


def greedy(model, n=6):
    return [int(t[0]) for t in generate_tokens(model, [[5, 9, 13, 2, 7]], SamplingParams(max_new_tokens=n), ())]


@pytest.mark.parametrize("kind", ["bf16", "int8", "int4"])
def test_reference_backend_runs_no_native_code(ckpts, kind, monkeypatch):
    native_here = native.library() is not None
    forbid_native(monkeypatch)
    model = load_model(ckpts[kind], dtype="bfloat16", kernel="reference")
    tokens = greedy(model)  # prefill and decode steps, through every op
    assert len(tokens) == 6
    assert all(m.ops is TorchOps for m in model.modules() if hasattr(type(m), "ops"))
    assert all(m.kernel is None or m.kernel.name == "reference" for m in model.modules()
               if isinstance(m, (Linear, QuantLinear)))
    if native_here:  # the same run on the default backend does call native code: the check can fail
        with pytest.raises(NativeCalled):
            greedy(load_model(ckpts[kind], dtype="bfloat16", kernel="auto"))


def test_auto_installs_native_ops_where_it_can(ckpts):
    model = load_model(ckpts["int4"], dtype="bfloat16")
    expected = NativeOps if native.library() is not None else TorchOps
    assert model.model.norm.ops is expected and model.model.layers[0].self_attn.ops is expected


def test_backend_is_chosen_once_and_can_be_changed(ckpts):
    model = load_model(ckpts["int4"], dtype="bfloat16", kernel="reference")
    ids = torch.tensor([[5, 9, 13, 2, 7]])
    with torch.no_grad():
        ref = model(ids).float()
        use_backend(model, "aten")
        assert model.model.layers[0].mlp.down_proj.kernel.name == "aten-int4"
        assert ((model(ids).float() - ref).norm() / ref.norm()) < 0.02
        assert torch.equal(model.state_dict()["model.layers.0.mlp.down_proj.qweight"],
                           load_model(ckpts["int4"], kernel="reference").model.layers[0].mlp.down_proj.qweight)


def test_unknown_backend_is_a_one_line_error(ckpts):
    with pytest.raises(QliteError, match="--kernel fast: choose reference, aten, native, native-a16, bnb, auto"):
        load_model(ckpts["bf16"], kernel="fast")


def test_the_cli_offers_every_backend():
    from qlite.cli import KERNEL_CHOICES
    assert sorted(KERNEL_CHOICES.choices) == sorted(BACKENDS)
