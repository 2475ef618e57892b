"""The calibrated methods (GPTQ, act-rtn) through a whole (tiny) checkpoint: same format as RTN, loads,
and fits the calibration text better than RTN does."""
import json

import pytest
import torch

from eval.run import evaluate
from qlite.loader import load_model
from qlite.errors import QliteError
from quantize.calibrate import calibrated_convert, calibration_ids, windows
from quantize.convert import convert
from tiny_models import make_checkpoint
from qlite.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("gptq")
    base = make_checkpoint(root / "base", seed=11, hidden_size=128, intermediate_size=256, num_hidden_layers=3)
    text = root / "calib.txt"
    text.write_text(" ".join(f"the {w} thin {w[::-1]} in" for w in ["tin", "hen", "net", "ten", "nit"] * 60))
    return base, text


def test_calibrated_checkpoints_load_and_beat_rtn_on_their_calibration_text(setup, tmp_path):
    base, text = setup
    kw = dict(bits=4, group_size=32, lm_head_bits=4, progress=False, calib=str(text), nsamples=8, seqlen=64)
    gptq = calibrated_convert(base, tmp_path / "gptq", **kw).out_dir
    ordered = calibrated_convert(base, tmp_path / "ordered", act_order=True, **kw).out_dir
    act = calibrated_convert(base, tmp_path / "act", method="act-rtn", **kw).out_dir
    rtn = convert(base, tmp_path / "rtn", bits=4, group_size=32, lm_head_bits=4, progress=False).out_dir
    q = json.loads((gptq / "config.json").read_text())["quantization_config"]
    assert q["method"] == "gptq" and q["nsamples"] == 8 and q["group_size"] == 32
    assert json.loads((act / "config.json").read_text())["quantization_config"]["method"] == "act-rtn"
    rtn_files = {n: t.shape for n, t in load_model(rtn, kernel="reference").state_dict().items()}
    for d in (gptq, act):
        assert {n: t.shape for n, t in load_model(d, kernel="reference").state_dict().items()} == rtn_files
    rows = evaluate([rtn, gptq, ordered, act], base, data=[str(text)], ctx=64, max_chunks=4, dtype="float32",
                    progress=False)
    kld = {r.model: r.metrics["kld_mean"] for r in rows}
    assert max(kld["gptq"], kld["ordered"], kld["act"]) < kld["rtn"], kld


def test_act_refuses_act_order(setup, tmp_path):
    base, text = setup
    with pytest.raises(QliteError, match="--act-order"):
        calibrated_convert(base, tmp_path / "x", method="act-rtn", act_order=True, calib=str(text), nsamples=2, seqlen=32)
    assert not (tmp_path / "x").exists()


def test_calibration_windows_and_builtin_text(setup):
    assert windows(list(range(100)), 3, 10) == [list(range(0, 10)), list(range(45, 55)), list(range(90, 100))]
    with pytest.raises(QliteError, match="fewer than --seqlen 200"):
        windows(list(range(100)), 2, 200)
    base, _ = setup
    ids = calibration_ids(Tokenizer(base), "builtin", 5, 32, 64)
    assert ids.shape == (5, 32)


def test_gptq_refuses_bnb_formats(capsys, setup, tmp_path):
    from qlite.cli import main
    base, _ = setup
    assert main(["quantize", str(base), "--method", "gptq", "--format", "nf4", "--out", str(tmp_path / "x")]) != 0
    assert "--method gptq" in capsys.readouterr().err


def test_gptq_with_quantized_embeddings_rounds_the_table_to_nearest(setup, tmp_path):
    """An untied model: GPTQ makes the linears, the int4 table is round to nearest (no Hessian for a
    lookup), exactly RTN's table."""
    from safetensors.torch import load_file
    base, text = setup
    kw = dict(bits=4, group_size=32, embed_bits=4, progress=False)
    gptq = calibrated_convert(base, tmp_path / "gptq", calib=str(text), nsamples=2, seqlen=32, **kw)
    rtn = convert(base, tmp_path / "rtn", **kw).out_dir
    assert gptq.embed_bits_per_weight == pytest.approx(4 + 24 / 32)
    assert gptq.fidelity["texts"]["prose"]["tokens"] > 0  # GPTQ's output carries its report too
    ours, theirs = load_file(gptq.out_dir / "model.safetensors"), load_file(rtn / "model.safetensors")
    for suffix in ("qweight", "scales", "zeros"):
        assert torch.equal(ours[f"model.embed_tokens.{suffix}"], theirs[f"model.embed_tokens.{suffix}"])
    assert not torch.equal(ours["model.layers.0.mlp.down_proj.qweight"], theirs["model.layers.0.mlp.down_proj.qweight"])


def test_the_cli_damp_default_is_the_library_one():
    """qlite.cli keeps the literal (importing qconfig would load torch for `qlite --help`)."""
    from qlite.cli import quantize
    from qlite.qconfig import DAMP

    assert next(p for p in quantize.params if p.name == "damp").default == DAMP


def test_an_expert_routed_few_tokens_is_calibrated_on_all_of_them():
    """The stated rule (calibrate.few_tokens_experts): an expert the router sent fewer than FEW_TOKENS tokens
    gets the Hessians of every token of its layer through it; one sent enough keeps its own."""
    from qlite.config import ModelConfig
    from qlite.decoder.mlp import SparseMLP
    from quantize.calibrate import FEW_TOKENS, few_tokens_experts
    from quantize.gptq import Hessian, hessian_of

    cfg = ModelConfig.from_dict(dict(model_type="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=1, num_attention_heads=2, num_experts=4,
                                     num_experts_per_tok=1, moe_intermediate_size=16))
    torch.manual_seed(0)
    mlp = SparseMLP(cfg, "model.layers.0.mlp.")
    for p in mlp.parameters():
        torch.nn.init.normal_(p)
    x = torch.randn(4 * FEW_TOKENS, 32)
    busy = torch.zeros(4 * FEW_TOKENS, dtype=torch.bool)
    busy[:FEW_TOKENS] = True  # expert 0: exactly FEW_TOKENS of them; the others: none
    names = [f"mlp.experts.{e}.{p}" for e in range(4) for p in ("gate_up_proj", "down_proj")]
    hessians = {n: Hessian(16 if n.endswith("down_proj") else 32) for n in names}
    hessians["mlp.experts.0.gate_up_proj"].add(x[busy])
    hooks = [mlp.experts[e].get_submodule(p).register_forward_hook(
        lambda m, inp, _, n=f"mlp.experts.{e}.{p}": hessians[n].add(inp[0]))
        for e in range(4) for p in ("gate_up_proj", "down_proj")]
    few_tokens_experts("mlp", mlp, x, hessians)
    for h in hooks:
        h.remove()
    assert hessians["mlp.experts.0.gate_up_proj"].tokens == FEW_TOKENS  # kept its own
    for e in range(1, 4):
        expert = mlp.experts[e]
        assert torch.allclose(hessians[f"mlp.experts.{e}.gate_up_proj"].matrix(), hessian_of(x), rtol=1e-4)
        inner = expert.ops.silu_mul(expert.gate_up_proj(x))
        assert torch.allclose(hessians[f"mlp.experts.{e}.down_proj"].matrix(), hessian_of(inner), rtol=1e-4, atol=1e-3)


def test_chat_calibration_is_coding_conversations_in_the_checkpoints_template(setup, tmp_path):
    from eval.code_tasks import TASKS
    from quantize.calibrate import chat_text

    base, _ = setup
    tokenizer = Tokenizer(base)
    text = chat_text(tokenizer)
    assert text.count("<|im_start|>user\n") == text.count("<|im_start|>assistant\n") == len(TASKS)
    assert TASKS[0].prompt in text and TASKS[0].solution.strip() in text  # the question's stub, its reference answer
    ids = calibration_ids(tokenizer, "chat", 4, 32, 64)
    stream = tokenizer.encode(text)
    assert ids.shape == (4, 32) and ids[0].tolist() == stream[:32] and ids[-1].tolist() == stream[-32:]
    bare = make_checkpoint(tmp_path / "bare", seed=1)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    (bare / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "chat_template"}))
    with pytest.raises(QliteError, match="--calib-data chat: the checkpoint has no chat template"):
        calibration_ids(Tokenizer(bare), "chat", 4, 32, 64)
