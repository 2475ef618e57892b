"""The one-call decode step (fused.py) against the module path it replaces: the same logits, bit for bit,
for every kind of product, split projections, per-head q/k norms, mixtures of experts, batches with left
padding, quantized KV caches, both instruction sets."""
import pytest
import torch

from qlite import native
from qlite.backends import use_backend
from qlite.formats import format_named
from qlite.fused import FusedLayers
from qlite.generate import left_padded
from qlite.kernels import Reference
from qlite.loader import load_model
from qlite.decoder.linear import SplitLinear
from qlite.decoder.ops import Step
from qlite.qconfig import QuantConfig
from tiny_models import MOE, NATIVE_WIDTHS, make_checkpoint

pytestmark = pytest.mark.skipif(native.library() is None, reason="native kernels unavailable here")


@pytest.fixture(autouse=True)
def isa(native_isa):
    return native_isa


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from quantize.convert import convert
    src = make_checkpoint(tmp_path_factory.mktemp("fused") / "bf16", **NATIVE_WIDTHS)
    out = {"bf16": src}
    for name, bits, group in (("int8", 8, None), ("int4", 4, 64), ("int4-g128", 4, 128)):
        out[name] = convert(src, src.parent / name, bits=bits, group_size=group, progress=False, report=False).out_dir
    # q_proj and gate_proj apart from k/v and up (SplitLinear), down_proj of layer 1 16-bit, int4k (coded scales)
    mixed = (("model.layers.0.self_attn.q_proj", format_named("int8")), ("model.layers.1.mlp.gate_proj", format_named("int8")),
             ("model.layers.1.mlp.down_proj", None), ("model.layers.0.mlp.down_proj", format_named("int4k-g64")),
             ("model.layers.1.self_attn.o_proj", format_named("int4k-g128")))
    qconfig = QuantConfig(format_named("int4-g64"), format_named("int8"), embeddings=None, module_formats=mixed)
    out["mix"] = convert(src, src.parent / "mix", qconfig, progress=False, report=False).out_dir
    # rotated formats (activations turned in each product): int3h-g128, q_proj and a gate_proj int4h apart
    turned = (("model.layers.0.self_attn.q_proj", format_named("int4h-g128")),
              ("model.layers.1.mlp.gate_proj", format_named("int4h-g64")))
    qconfig = QuantConfig(format_named("int3h-g128"), format_named("int8"), embeddings=None, module_formats=turned)
    out["rotated"] = convert(src, src.parent / "rotated", qconfig, progress=False, report=False).out_dir
    # mixtures of experts: Qwen3-MoE (per-head q/k norms) in int4, Qwen2-MoE (shared expert, a dense layer) 16-bit and int8
    moe3 = make_checkpoint(tmp_path_factory.mktemp("fused") / "moe3", model_type="qwen3_moe", **MOE["qwen3_moe"])
    out["moe3-int4"] = convert(moe3, moe3.parent / "moe3-int4", bits=4, group_size=64, progress=False,
                               report=False).out_dir
    out["moe2-bf16"] = make_checkpoint(tmp_path_factory.mktemp("fused") / "moe2", model_type="qwen2_moe", **MOE["qwen2_moe"])
    out["moe2-int8"] = convert(out["moe2-bf16"], out["moe2-bf16"].parent / "moe2-int8", bits=8, progress=False,
                               report=False).out_dir
    return out


def decode_logits(model, prompts, steps=6):
    """Logits of a greedy decode of the left-padded prompts: (steps + 1, B, vocab). The cache starts one
    token past the prompt and grows (reallocated) as the steps come, as generate's does."""
    capacity = max(map(len, prompts)) + steps
    ids, key_mask, positions = left_padded(prompts, capacity)
    L = ids.shape[1]
    padded = not bool(key_mask[:, :L].all())
    cache = model.new_cache(len(prompts), L + 1, limit=capacity)
    with torch.inference_mode():
        logits = [model(ids, cache, positions, key_mask[:, :L] if padded else None, last_only=True)[:, -1]]
        pos = positions[:, -1:] + 1
        for step in range(steps):
            key_mask[:, L + step] = True
            token = logits[-1].float().argmax(-1, keepdim=True)
            logits.append(model(token, cache, pos, key_mask[:, :L + step + 1] if padded else None)[:, -1])
            pos = pos + 1
    return torch.stack(logits)


@pytest.mark.parametrize("kernel", ["native", "native-a16"])
@pytest.mark.parametrize("kind", ["bf16", "int8", "int4", "int4-g128", "mix", "rotated", "moe3-int4", "moe2-bf16",
                                  "moe2-int8"])
@pytest.mark.parametrize("prompts", [[list(range(3, 20))], [list(range(3, 20)), [7, 8, 9], list(range(40, 52))]],
                         ids=["one", "padded-batch"])
def test_the_fused_step_is_the_module_path_bit_for_bit(ckpts, kind, kernel, prompts, monkeypatch):
    if kernel == "native" and not native.vnni_ready():
        pytest.skip("no integer-activation kernels (AVX-512 without VNNI)")
    model = load_model(ckpts[kind], dtype="bfloat16", kernel=kernel)
    check_fused_against_module_path(model, kind, prompts, monkeypatch)


@pytest.mark.parametrize("kv_cache", ["int8", "int4"])
@pytest.mark.parametrize("prompts", [[list(range(3, 20)), [7, 8, 9], list(range(40, 52))]], ids=["padded-batch"])
def test_the_fused_step_with_a_quantized_cache_is_the_module_path_bit_for_bit(ckpts, kv_cache, prompts, monkeypatch):
    model = load_model(ckpts["int4"], dtype="bfloat16", kernel="native-a16", kv_cache=kv_cache)
    assert model.new_cache(1, 4).k.dtype == torch.uint8 and model.key_offsets() is not None
    check_fused_against_module_path(model, "int4", prompts, monkeypatch)


def check_fused_against_module_path(model, kind, prompts, monkeypatch):
    fused = model.model.fused_layers
    assert fused is not None
    if kind == "mix":
        attn, mlp = model.model.layers[0].self_attn, model.model.layers[1].mlp
        assert isinstance(attn.qkv_proj, SplitLinear) and isinstance(mlp.gate_up_proj, SplitLinear)
        assert mlp.down_proj.kernel.name == "native-bf16"
    calls = []
    monkeypatch.setattr(FusedLayers, "__call__", lambda self, x, step: calls.append(1) or fused_call(self, x, step))
    got = decode_logits(model, prompts)
    assert len(calls) == 6  # every decode step, no prefill
    model.model.fused_layers = None
    want = decode_logits(model, prompts)
    assert torch.equal(got, want)


fused_call = FusedLayers.__call__


@pytest.mark.parametrize("kind,kernel,kv_cache", [("bf16", "native", "bf16"), ("int8", "native", "bf16"),
                                                  ("int4", "native", "bf16"), ("mix", "native-a16", "bf16"),
                                                  ("int4", "native", "int8"), ("int4-g128", "native", "int4")])
def test_a_verify_pass_in_one_call_is_the_module_path_bit_for_bit(ckpts, kind, kernel, kv_cache, monkeypatch):
    """Speculation's verify forward (exact: T new tokens of one sequence, each as its own step) through the
    fused layers: the logits of every row and the cache's records those of the module path, bit for bit."""
    if kernel == "native" and not native.vnni_ready():
        pytest.skip("no integer-activation kernels (AVX-512 without VNNI)")
    model = load_model(ckpts[kind], dtype="bfloat16", kernel=kernel, kv_cache=kv_cache)
    calls = []
    monkeypatch.setattr(FusedLayers, "__call__", lambda self, x, step: calls.append(x.shape) or fused_call(self, x, step))

    def verify():
        cache = model.new_cache(1, 40)
        with torch.inference_mode():
            model(torch.arange(3, 20)[None], cache, last_only=True)
            out = [model(torch.tensor([[7, 8, 9, 10, 11, 12, 13, 14]]), cache, exact=True),
                   model(torch.tensor([[21, 22]]), cache, exact=True)]
        return out, cache.k[:, :, :, :27].clone(), cache.v[:, :, :, :27].clone()

    got = verify()
    assert [shape[1] for shape in calls] == [8, 2]  # both passes in the fused layers, not the prompt
    model.model.fused_layers = None
    want = verify()
    assert all(torch.equal(a, b) for a, b in zip(got[0], want[0]))
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])


def test_a_layer_off_the_native_kernels_keeps_the_module_path(ckpts):
    model = load_model(ckpts["int4"], dtype="bfloat16", kernel="native")
    assert model.model.fused_layers is not None
    layer = model.model.layers[1].mlp.down_proj
    layer.kernel = Reference(layer)
    assert FusedLayers.build(model.model) is None
    layer.kernel, layer.input_order = None, torch.arange(layer.in_features)
    use_backend(model, "native")  # a permuted input (act-order GPTQ) is the module's to apply
    assert model.model.fused_layers is None
    assert load_model(ckpts["int4"], dtype="bfloat16", kernel="aten").model.fused_layers is None
    assert load_model(ckpts["bf16"], dtype="float32").model.fused_layers is None


def test_a_step_it_does_not_take_or_a_wrong_cache(ckpts):
    model = load_model(ckpts["int8"], dtype="bfloat16", kernel="native")
    fused = model.model.fused_layers
    x = torch.zeros(1, 1, NATIVE_WIDTHS["hidden_size"], dtype=torch.bfloat16)
    cache, cos, sin = model.new_cache(1, 8), torch.zeros(1, 1, 1, 64), torch.zeros(1, 1, 1, 64)
    assert fused.takes(x, Step(cos, sin, cache, None, 0))
    two = torch.zeros(1, 2, x.shape[-1], dtype=torch.bfloat16)
    assert not fused.takes(two, Step(cos, sin, cache, None, 0))  # two tokens, not each as its own step
    assert fused.takes(two, Step(cos, sin, cache, None, 0, one_at_a_time=True))
    assert not fused.takes(torch.zeros(2, 2, x.shape[-1], dtype=torch.bfloat16), Step(cos, sin, cache, None, 0,
                                                                                     one_at_a_time=True))
    assert not fused.takes(x, Step(cos, sin, None, None, 0))
    assert not fused.takes(x, Step(cos, sin, cache, torch.ones(1, 1, 1, 1, dtype=torch.bool), 0))
    with pytest.raises(ValueError, match="at 8"):
        fused(x, Step(cos, sin, cache, None, 8))  # past the cache's capacity
    cache.k = cache.k[:1]
    with pytest.raises(ValueError, match="cache"):
        fused(x, Step(cos, sin, cache, None, 0))
