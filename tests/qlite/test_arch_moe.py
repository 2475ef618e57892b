"""Mixtures of experts against transformers' Qwen2MoeForCausalLM and Qwen3MoeForCausalLM on tiny random
checkpoints it writes itself (per-expert names, as the hub's files): a router's top-k experts, Qwen2-MoE's
shared expert under its sigmoid gate and a dense layer among sparse ones, Qwen3-MoE's renormalized
weights. Logits, greedy text, quantize / generate / chat / serve, GGUF's merged expert tensors, and a batch
of concurrent clients answered as each alone. Every preset on them: tests/quantize/test_presets.py."""
import io
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from arch_checks import (assert_gguf_round_trip, assert_greedy_matches, assert_int4_quantizes_generates_and_serves,
                         assert_logits_match, serve_once)
from cli_checks import assert_one_line_error, run_cli
from qlite.config import ModelConfig
from qlite.errors import QliteError
from qlite.pipeline import load
from qlite.serve.engine import Engine
from tiny_models import MOE, TINY, make_checkpoint

SMALL = {  # widths below the native kernels': the reference path, as transformers computes
    "qwen2_moe": dict(num_hidden_layers=3, intermediate_size=96, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64, mlp_only_layers=[1]),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True, head_dim=32),
}


@pytest.fixture(scope="module", params=sorted(SMALL))
def small(request, tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp(request.param) / "ckpt", model_type=request.param, **SMALL[request.param])


@pytest.mark.parametrize("model_type, overrides", [
    ("qwen2_moe", {}), ("qwen2_moe", {"tie_word_embeddings": True, "norm_topk_prob": True, "decoder_sparse_step": 2}),
    ("qwen2_moe", {"qkv_bias": False, "mlp_only_layers": []}),
    ("qwen3_moe", {}), ("qwen3_moe", {"tie_word_embeddings": True, "norm_topk_prob": False, "mlp_only_layers": [0]}),
], ids=["shared-expert-dense-layer", "tied-renormalized-every-second", "no-bias-all-sparse", "qwen3", "qwen3-tied-dense-first"])
def test_logits_match_transformers(tmp_path, model_type, overrides):
    assert_logits_match(make_checkpoint(tmp_path / "ckpt", model_type=model_type, **{**SMALL[model_type], **overrides}))


def test_greedy_matches_transformers(small):
    assert_greedy_matches(small)


def test_int4_quantizes_generates_and_serves(small, tmp_path, capsys):
    assert_int4_quantizes_generates_and_serves(small, tmp_path, capsys)


def test_only_the_chosen_experts_run(small, monkeypatch):
    """A token reads its k experts and no other (decode never pages in an expert it does not use); prefill runs
    each chosen expert once over all its tokens."""
    lm = load(small, dtype="float32")
    layer = next(layer for layer in lm.model.model.layers if hasattr(layer.mlp, "experts"))
    calls = []
    for e, expert in enumerate(layer.mlp.experts):
        monkeypatch.setattr(expert, "forward", lambda x, e=e, f=expert.forward: calls.append((e, x.shape[0])) or f(x))
    x = torch.randn(1, 5, lm.model.config.hidden_size)
    chosen, _ = layer.mlp.route(x.reshape(5, -1))
    layer.mlp(x)
    assert sorted(calls) == sorted((e, int((chosen == e).sum())) for e in chosen.unique().tolist())
    calls.clear()
    layer.mlp(x[:, :1])
    assert sorted(e for e, _ in calls) == sorted(chosen[0].tolist()) and all(n == 1 for _, n in calls)


@pytest.mark.parametrize("model_type", sorted(MOE))
def test_int8_and_the_default_quantize_generate_chat_and_serve(model_type, tmp_path, capsys, monkeypatch):
    src = make_checkpoint(tmp_path / "src", model_type=model_type, **MOE[model_type])
    for flags, name in ((["--bits", "8"], "int8"), ([], "default")):
        out = tmp_path / name
        code, _, err = run_cli(capsys, "quantize", src, "--out", out, *flags)
        assert code == 0, err
        monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"hi there\n/quit\n")))
        code, text, err = run_cli(capsys, "chat", "-m", out, "--max-new-tokens", "6")
        assert code == 0 and text, err
        code, text, err = run_cli(capsys, "generate", "-m", out, "-p", "the thin tin", "--max-new-tokens", "6")
        assert code == 0 and text, err
        serve_once(out)
        code, text, _ = run_cli(capsys, "info", out)
        assert code == 0 and f"experts 8 x 128 ({MOE[model_type]['num_experts_per_tok']} per token" in text


@pytest.mark.parametrize("model_type", sorted(MOE))
def test_eight_concurrent_clients_get_their_answers_alone(model_type, tmp_path):
    from tests.qlite.serve.test_server import PROMPTS, chat, running
    src = make_checkpoint(tmp_path / "src", model_type=model_type, **MOE[model_type])
    lm = load(src, dtype="float32")
    want = [lm.generate([{"role": "user", "content": p}], max_new_tokens=12) for p in PROMPTS]
    with running(lm, Engine(lm, max_batch=8, ctx=128, max_queue=8).start()) as (port, _):
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda p: chat(port, p, max_tokens=12)["choices"][0]["message"]["content"], PROMPTS))
    assert got == want


@pytest.mark.parametrize("model_type, gguf_arch", [("qwen2_moe", "qwen2moe"), ("qwen3_moe", "qwen3moe")])
def test_gguf_export_merges_the_experts_and_imports_back(model_type, gguf_arch, tmp_path):
    """llama.cpp's names and layout: a layer's experts as one (experts, rows, columns) tensor, the router as
    ffn_gate_inp, the shared expert's _shexp tensors; imported back to transformers' logits."""
    from gguf import GGUFReader

    head_dim = 32 if model_type == "qwen3_moe" else TINY["hidden_size"] // TINY["num_attention_heads"]  # llama.cpp's qwen2moe
    src = make_checkpoint(tmp_path / "src", model_type=model_type,
                          **{**SMALL[model_type], "mlp_only_layers": [], "moe_intermediate_size": 64, "head_dim": head_dim})
    assert_gguf_round_trip(src, tmp_path, gguf_arch)
    reader = GGUFReader(tmp_path / "model.gguf")
    shapes = {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}
    assert shapes["blk.0.ffn_gate_exps.weight"] == (TINY["hidden_size"], 64, 8)  # ggml's order: columns first
    assert shapes["blk.0.ffn_down_exps.weight"] == (64, TINY["hidden_size"], 8)
    assert shapes["blk.0.ffn_gate_inp.weight"] == (TINY["hidden_size"], 8)
    assert ("blk.0.ffn_up_shexp.weight" in shapes) == (model_type == "qwen2_moe")
    assert reader.fields[f"{gguf_arch}.expert_used_count"].contents() == SMALL[model_type]["num_experts_per_tok"]


@pytest.mark.parametrize("model_type, overrides, needle", [
    ("qwen2_moe", {}, "dense layers among sparse ones"),  # mlp_only_layers [1]
    ("qwen2_moe", {"mlp_only_layers": [], "norm_topk_prob": True}, "always keeps"),
    ("qwen3_moe", {"norm_topk_prob": False}, "always renormalizes"),
    ("qwen2_moe", {"mlp_only_layers": [], "head_dim": 32}, "takes q and o as hidden x hidden"),
])
def test_a_gguf_llama_cpp_cannot_hold_is_refused_in_one_line(model_type, overrides, needle, tmp_path, capsys):
    src = make_checkpoint(tmp_path / "src", model_type=model_type, **{**SMALL[model_type], **overrides})
    capsys.readouterr()
    code, _, err = run_cli(capsys, "export", src, "--to", "gguf", "--out", tmp_path / "m.gguf")
    assert_one_line_error(code, err, needle, "not exported")
    assert not (tmp_path / "m.gguf").exists()


BASE = dict(TINY, model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)


@pytest.mark.parametrize("overrides, needle", [
    ({"num_experts_per_tok": 9}, "num_experts_per_tok 9 is more than num_experts 8"),
    ({"num_local_experts": 4}, "num_experts 8 and num_local_experts 4 disagree"),
    ({"num_experts": None}, "num_experts is missing"),
    ({"moe_intermediate_size": 0}, "moe_intermediate_size must be positive"),
    ({"mlp_only_layers": "0"}, "mlp_only_layers must be a list"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step must be positive"),
    ({"num_experts_per_tok": "2"}, "num_experts_per_tok must be an integer"),
])
def test_bad_expert_fields_are_refused_by_name(overrides, needle):
    with pytest.raises(QliteError, match=needle):
        ModelConfig.from_dict({k: v for k, v in {**BASE, **overrides}.items() if v is not None})


def test_a_layer_read_with_its_experts_as_stored_computes_as_the_float32_layer(small, tmp_path):
    """float_layer(experts_as_stored=True), what the sensitivity pass and the report's reference read: a bf16
    source's experts stay bf16 (no float32 copy of 128 experts), every other tensor float32, and the layer's
    output and its input's gradient are the float32 layer's."""
    import shutil
    from safetensors.torch import load_file, save_file
    from qlite.checkpoint import CheckpointDir
    from qlite.loader import float_layer
    from quantize.source_pass import embedded, float_config
    bf16 = tmp_path / "bf16"
    shutil.copytree(small, bf16)
    for f in bf16.glob("*.safetensors"):
        save_file({k: v.bfloat16() for k, v in load_file(f).items()}, f, metadata={"format": "pt"})
    ckpt = CheckpointDir(bf16)
    cfg = float_config(ckpt)
    i = next(i for i in range(cfg.num_hidden_layers) if cfg.experts.sparse(i))
    windows = embedded(ckpt, torch.randint(0, cfg.vocab_size, (2, 9)))
    outs = []
    for as_stored in (False, True):
        layer = float_layer(ckpt, cfg, i, experts_as_stored=as_stored).requires_grad_(False)
        dtypes = {name: p.dtype for name, p in layer.named_parameters()}
        assert {d for n, d in dtypes.items() if ".experts." not in n} == {torch.float32}
        assert {d for n, d in dtypes.items() if ".experts." in n} == {torch.bfloat16 if as_stored else torch.float32}
        x = windows.x.clone().requires_grad_()
        y = layer(x, windows.step)
        outs.append((y, torch.autograd.grad(y, x, torch.ones_like(y))[0]))
    (y, g), (y_stored, g_stored) = outs
    torch.testing.assert_close(y_stored, y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g_stored, g, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def default_file(tmp_path_factory):
    """Qwen3-MoE at the native kernels' widths, quantized with the default preset, loaded as `qlite` runs it."""
    from qlite.cli import main
    src = make_checkpoint(tmp_path_factory.mktemp("moe-q4") / "src", model_type="qwen3_moe", **MOE["qwen3_moe"])
    assert main(["quantize", str(src), "--out", str(src.parent / "q4"), "--no-report"]) == 0
    return src.parent / "q4"


def test_an_expert_is_read_when_first_chosen(default_file):
    """Loading makes no expert's buffers (tiled codes) and pages none of them in; a step makes its k chosen
    experts' and no other's."""
    from qlite.loader import load_model
    model = load_model(default_file)
    mlp = model.model.layers[0].mlp
    kernels = [e.gate_up_proj.kernel for e in mlp.experts]
    if not all(getattr(k, "deferrable", False) for k in kernels):
        pytest.skip("no native kernels here")
    assert all(k._product is None for k in kernels)
    with torch.no_grad():
        model(torch.tensor([[5]]), cache=model.new_cache(1, 8))
    built = {e for e, k in enumerate(kernels) if k._product is not None}
    assert len(built) == MOE["qwen3_moe"]["num_experts_per_tok"]


def test_experts_kept_within_a_budget_give_the_same_logits(default_file):
    """Under tiled_experts_within(0) (the quantization report's forward) only the running layer's experts stay
    made: each earlier layer's are let go when the next makes its own, and made again when chosen; the logits
    are the same bits, prefill and steps, and on leaving none is held."""
    from qlite.loader import load_model
    from qlite.native_moe import tiled_experts_within
    model = load_model(default_file)
    layers = [layer.mlp for layer in model.model.layers]
    if any(getattr(mlp, "native", None) is None for mlp in layers):
        pytest.skip("no native sparse MLP here")
    made = lambda mlp: {e for e, k in enumerate(mlp.experts) if k.down_proj.kernel._product is not None}  # noqa: E731
    ids = torch.tensor([[5, 9, 300, 17, 2, 44, 8, 100]])
    with torch.no_grad():
        want = model(ids)
        assert all(made(mlp) for mlp in layers)  # unbounded: every layer's chosen experts stay made
        for mlp in layers:
            for e in made(mlp):
                mlp.native.let_go(e)
        with tiled_experts_within(0):
            got = model(ids)
            assert [bool(made(mlp)) for mlp in layers] == [False] * (len(layers) - 1) + [True]
            again = model(ids)
        assert not any(made(mlp) for mlp in layers)
    assert torch.equal(got, want) and torch.equal(again, want)


def test_the_native_mix_is_the_module_path_and_row_exact(default_file):
    """NativeOps' one call a layer gives the bits of the experts' own kernels run one by one (TorchOps' loop
    over the same products), and each token of a prefill what it gets alone (the products are row-exact)."""
    from qlite import native
    from qlite.decoder.ops import TorchOps
    from qlite.loader import load_model
    if not native.vnni_ready():
        pytest.skip("no integer-activation kernels here")
    model = load_model(default_file)
    mlp = model.model.layers[1].mlp
    x = torch.randn(1, 24, MOE["qwen3_moe"]["hidden_size"], generator=torch.Generator().manual_seed(3)).bfloat16()
    native_ops = mlp.ops
    with torch.no_grad():
        ours = mlp(x)
        mlp.ops = TorchOps
        loop = mlp(x)
        mlp.ops = native_ops
        alone = torch.cat([mlp(x[:, t:t + 1]) for t in range(24)], dim=1)
    assert native_ops is not TorchOps and torch.equal(ours, loop) and torch.equal(ours, alone)


def test_a_prefill_is_bitwise_its_one_token_steps(default_file):
    """Routers and experts row-exact (the router's bf16 product at every row count, the experts' integer
    products): a prompt's logits do not depend on how it is cut, so the prompt cache stays on."""
    from qlite.backends import exact_prefill
    from qlite.loader import load_model
    model = load_model(default_file)
    if not exact_prefill(model):
        pytest.skip("no integer-activation kernels here")
    ids = torch.randint(0, 260, (1, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        whole = model(ids, cache=model.new_cache(1, 32))
        cache = model.new_cache(1, 32)
        steps = torch.cat([model(ids[:, t:t + 1], cache=cache) for t in range(20)], dim=1)
    assert torch.equal(whole, steps)


def token_bytes(tok, ids) -> bytes:
    """The bytes byte-level BPE tokens stand for (GPT-2's printable mapping undone)."""
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    codes = printable + [256 + i for i in range(256 - len(printable))]
    order = printable + [b for b in range(256) if b not in printable]
    back = {chr(c): b for b, c in zip(order, codes)}
    return b"".join(bytes(back[ch] for ch in tok.id_to_token(i)) for i in ids)


@pytest.mark.parametrize("model_type, extra", [("qwen2_moe", {"mlp_only_layers": []}), ("qwen3_moe", {})])
def test_llama_cpp_runs_the_int8_gguf_to_transformers_greedy_tokens(model_type, extra, tmp_path):
    """llama.cpp's own llama-simple (greedy) on the int8 export writes transformers' 12 tokens. Runs where
    QLITE_LLAMA_CPP_BIN names a llama.cpp build's bin directory (BENCHMARKS.md says how it was built)."""
    import os
    import subprocess
    from pathlib import Path

    from tokenizers import Tokenizer

    from qlite.cli import main
    from tiny_models import hf_model
    bin_dir = Path(os.environ.get("QLITE_LLAMA_CPP_BIN", "/nonexistent"))
    if not (bin_dir / "llama-simple").exists():
        pytest.skip("QLITE_LLAMA_CPP_BIN does not name a llama.cpp bin directory with llama-simple")
    src = make_checkpoint(tmp_path / "src", seed=5, model_type=model_type, **{**MOE[model_type], **extra, "vocab_size": 266})
    assert main(["quantize", str(src), "--bits", "8", "--out", str(tmp_path / "int8"), "--no-report"]) == 0
    assert main(["export", str(tmp_path / "int8"), "--to", "gguf", "--out", str(tmp_path / "m.gguf")]) == 0
    tok, prompt, n = Tokenizer.from_file(str(src / "tokenizer.json")), "the thin tin in the hen", 12
    ids = torch.tensor([tok.encode(prompt).ids])
    ref = hf_model(src)
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, ref(ids).logits[0, -1].argmax().view(1, 1)], dim=1)
    r = subprocess.run([str(bin_dir / "llama-simple"), "-m", str(tmp_path / "m.gguf"), "-n", str(n), prompt],
                       capture_output=True, env={"LD_LIBRARY_PATH": str(bin_dir)}, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.rstrip(b"\n") == prompt.encode() + token_bytes(tok, ids[0, -n:].tolist())
