"""Checkpoint -> quantized checkpoint -> load, against a float model holding the dequantized weights."""
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qlite.loader import load_model
from qlite.cli import main
from qlite.errors import QliteError
from qlite.decoder.linear import SplitLinear
from qlite.qconfig import QuantConfig
from qlite.qembedding import QuantEmbedding
from qlite.qlinear import QuantLinear
from quantize.convert import convert
from tiny_models import make_checkpoint

QDIMS = dict(hidden_size=128, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("qsrc") / "ckpt", seed=5, **QDIMS)


@pytest.fixture(scope="module")
def tied_src(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("qtied") / "ckpt", seed=6, tie_word_embeddings=True, **QDIMS)


def dir_digest(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(path.rglob("*")):
        h.update(f.name.encode())
        if f.is_file():
            h.update(f.read_bytes())
    return h.hexdigest()


def dequantized_twin(quantized_dir: Path, src_dir: Path):
    """The float32 source model with every quantized linear replaced by its dequantized weight (a
    projection split apart in the quantized model is split in the twin too)."""
    q = load_model(quantized_dir, dtype="float32", kernel="reference")
    twin = load_model(src_dir, dtype="float32")
    twin_modules = dict(twin.named_modules())
    for name, mod in q.named_modules():
        if isinstance(mod, SplitLinear):  # the twin's fused rows, split the same way
            fused, row = twin_modules[name], 0
            parts = {}
            for part, linear in mod.items():
                rows = slice(row, row + linear.out_features)
                parts[part] = torch.nn.Linear(linear.in_features, linear.out_features, bias=fused.bias is not None)
                parts[part].weight = torch.nn.Parameter(fused.weight[rows])
                if fused.bias is not None:
                    parts[part].bias = torch.nn.Parameter(fused.bias[rows])
                row += linear.out_features
            parent, _, attr = name.rpartition(".")
            setattr(twin_modules[parent], attr, SplitLinear(parts))
            twin_modules = dict(twin.named_modules())
    if isinstance(q.model.embed_tokens, QuantEmbedding):  # the dequantized table (a tied twin head keeps its own)
        table = q.model.embed_tokens
        twin.model.embed_tokens.weight = torch.nn.Parameter(table.fmt.dequantize(table.stored(), table.embedding_dim))
    for name, mod in q.named_modules():
        if isinstance(mod, QuantLinear):
            target = twin_modules[name]
            if name == "lm_head" and twin.config.tie_word_embeddings:
                target = twin.lm_head = torch.nn.Linear(mod.in_features, mod.out_features, bias=False)
            target.weight = torch.nn.Parameter(mod.dequantize())
    return q, twin


@pytest.mark.parametrize("bits, group, sym, head, scheme", [
    (8, None, True, 8, "int"), (4, 64, False, 8, "int"), (4, 32, True, 4, "int"), (4, 64, False, 16, "int"),
    (8, 64, True, 16, "int"), (4, 32, False, 8, "intk"), (4, 64, True, 16, "nf4"), (8, None, True, 16, "llm.int8")])
def test_quantized_model_equals_its_dequantized_twin(src, tmp_path, bits, group, sym, head, scheme):
    out = convert(src, tmp_path / "q", bits=bits, group_size=group, symmetric=sym, lm_head_bits=head,
                  scheme=scheme, progress=False).out_dir
    q, twin = dequantized_twin(out, src)
    ids = torch.randint(0, 500, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = twin(ids)
        assert (q(ids) - expected).abs().max() <= 1e-4  # reference kernel: float rounding only
        fast = load_model(out, dtype="bfloat16")(ids).float()  # the default (fast) kernels
    assert ((fast - expected).norm() / expected.norm()) <= 0.03
    assert isinstance(q.lm_head, QuantLinear) == (head != 16)
    assert isinstance(q.model.layers[0].self_attn.qkv_proj, QuantLinear)  # q/k/v fused in the stored layout


def test_a_skip_that_splits_a_fused_projection(src, tmp_path):
    """--skip k_proj: q/v quantized, k 16-bit, so q/k/v cannot be one matmul and stay apart."""
    out = convert(src, tmp_path / "q", bits=4, group_size=64, skip=("k_proj", "up_proj"), progress=False).out_dir
    q, twin = dequantized_twin(out, src)
    qkv, gate_up = q.model.layers[0].self_attn.qkv_proj, q.model.layers[0].mlp.gate_up_proj
    assert isinstance(qkv, SplitLinear) and list(qkv) == ["q_proj", "k_proj", "v_proj"]
    assert isinstance(qkv.q_proj, QuantLinear) and not isinstance(qkv.k_proj, QuantLinear)
    assert isinstance(gate_up, SplitLinear) and not isinstance(gate_up.up_proj, QuantLinear)
    ids = torch.randint(0, 500, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (q(ids) - twin(ids)).abs().max() <= 1e-4


def test_saved_tensors_reload_bit_identical(src, tmp_path):
    out = convert(src, tmp_path / "q", bits=4, group_size=64, progress=False).out_dir
    stored = load_file(out / "model.safetensors")
    source = load_file(src / "model.safetensors")
    qcfg = QuantConfig.from_dict(json.loads((out / "config.json").read_text())["quantization_config"], "config")
    for name, w in source.items():
        module = name.removesuffix(".weight")
        fmt = qcfg.format_for(module) if name.endswith(".weight") and w.ndim == 2 else None
        if fmt is None:
            assert torch.equal(stored[name], w)
        else:
            for suffix, t in fmt.quantize(w).items():
                assert torch.equal(stored[f"{module}.{suffix}"], t), f"{module}.{suffix}"
    again = convert(src, tmp_path / "q2", bits=4, group_size=64, progress=False).out_dir
    assert (out / "model.safetensors").read_bytes() == (again / "model.safetensors").read_bytes()
    model = load_model(out)  # the default kernels keep the canonical buffers
    assert torch.equal(model.model.layers[1].mlp.down_proj.qweight, stored["model.layers.1.mlp.down_proj.qweight"])
    qkv = model.model.layers[1].self_attn.qkv_proj.state_dict()
    for suffix in ("qweight", "scales", "zeros", "bias"):
        parts = [stored[f"model.layers.1.self_attn.{p}_proj.{suffix}"] for p in "qkv"]
        assert torch.equal(qkv[suffix], torch.cat(parts).to(qkv[suffix].dtype)), suffix  # bias: run dtype


def test_tied_16_bit_embeddings_get_an_own_quantized_head(tied_src, tmp_path):
    out = convert(tied_src, tmp_path / "q", bits=8, group_size=None, embed_bits=16, progress=False).out_dir
    stored = load_file(out / "model.safetensors")
    source = load_file(tied_src / "model.safetensors")
    assert "lm_head.qweight" in stored and "lm_head.weight" not in source
    assert torch.equal(stored["model.embed_tokens.weight"], source["model.embed_tokens.weight"])  # not quantized
    q, twin = dequantized_twin(out, tied_src)
    ids = torch.randint(0, 500, (1, 7))
    with torch.no_grad():
        assert (q(ids) - twin(ids)).abs().max() <= 1e-4


@pytest.mark.parametrize("embed_bits, group", [(8, None), (4, 32)])
def test_quantized_embeddings_round_trip_and_match_the_dequantized_table(src, tmp_path, embed_bits, group):
    out = convert(src, tmp_path / "q", bits=4, group_size=group or 64, embed_bits=embed_bits, progress=False)
    stored = load_file(out.out_dir / "model.safetensors")
    fmt = QuantConfig.from_dict(json.loads((out.out_dir / "config.json").read_text())["quantization_config"],
                                "config").embeddings
    assert fmt.name == ("int8" if embed_bits == 8 else "int4-g32")
    source = load_file(src / "model.safetensors")["model.embed_tokens.weight"]
    assert "model.embed_tokens.weight" not in stored
    for suffix, t in fmt.quantize(source).items():  # exactly what the format makes, through the file
        assert torch.equal(stored[f"model.embed_tokens.{suffix}"], t), suffix
    assert out.embed_bits_per_weight == pytest.approx(fmt.bits_per_weight(source.shape[1]))
    assert out.bits_per_parameter == pytest.approx(8 * out.bytes_after / sum(
        t.numel() for t in load_file(src / "model.safetensors").values()))
    q, twin = dequantized_twin(out.out_dir, src)
    assert isinstance(q.model.embed_tokens, QuantEmbedding)
    ids = torch.randint(0, 500, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (q(ids) - twin(ids)).abs().max() <= 1e-4
        fast = load_model(out.out_dir, dtype="bfloat16")(ids).float()
        assert ((fast - twin(ids)).norm() / twin(ids).norm()) <= 0.03


def test_tied_table_and_head_of_one_format_are_stored_once(tied_src, tmp_path):
    """Tied, --embed-bits 8 and an int8 head: one int8 table in the file, the head reads it (shared
    buffers); the output is the dequantized tied twin's."""
    out = convert(tied_src, tmp_path / "q", bits=4, group_size=64, embed_bits=8, progress=False)
    stored = load_file(out.out_dir / "model.safetensors")
    assert not any(k.startswith("lm_head.") for k in stored) and "model.embed_tokens.qweight" in stored
    assert out.head_is_table and "lm_head is the embedding table" in str(out)
    own = convert(tied_src, tmp_path / "own", bits=4, group_size=64, embed_bits=4, progress=False)
    assert "lm_head.qweight" in load_file(own.out_dir / "model.safetensors") and not own.head_is_table
    model = load_model(out.out_dir)
    assert model.lm_head.qweight.data_ptr() == model.model.embed_tokens.qweight.data_ptr()
    q, twin = dequantized_twin(out.out_dir, tied_src)
    ids = torch.randint(0, 500, (1, 7))
    with torch.no_grad():
        assert (q(ids) - twin(ids)).abs().max() <= 1e-4
    float_head = convert(tied_src, tmp_path / "fh", bits=4, group_size=64, embed_bits=8, lm_head_bits=16,
                         progress=False).out_dir  # the head keeps the float table as its own tensor
    assert torch.equal(load_file(float_head / "model.safetensors")["lm_head.weight"],
                       load_file(tied_src / "model.safetensors")["model.embed_tokens.weight"])
    q, twin = dequantized_twin(float_head, tied_src)
    with torch.no_grad():
        assert (q(ids) - twin(ids)).abs().max() <= 1e-4


def test_sharded_output_and_defaults(src, tmp_path):
    import shutil
    local = tmp_path / "ckpt"
    shutil.copytree(src, local)
    summary = convert(local, bits=4, group_size=64, max_shard_bytes=100_000, progress=False)
    assert summary.out_dir == tmp_path / "ckpt-int4-g64"
    assert (summary.out_dir / "model.safetensors.index.json").exists()
    assert (summary.out_dir / "tokenizer.json").exists() and (summary.out_dir / "generation_config.json").exists()
    assert summary.bytes_after < summary.bytes_before / 2.5
    assert summary.linear_bits_per_weight == pytest.approx(4 + 24 / 64)
    load_model(summary.out_dir)


def run_cli(capsys, *args):
    code = main([str(a) for a in args])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--bits", "5"], "--bits': '5' is not one of"),
    (["--bits", "3"], "--bits 3: --format int has 4, 8 bits"),
    (["--format", "intk", "--bits", "3", "--group-size", "48"], "16, 32, 64 or 128, not 48"),
    (["--format", "intk", "--bits", "2"], "multiples of 128"),
    (["--group-size", "0"], "--group-size': 0 is not >= 1"),
    (["--group-size", "100"], "--group-size: group size 100 does not divide"),
    (["--bits", "8", "--lm-head-bits", "2"], "--lm-head-bits"),
    (["--format", "intk", "--bits", "8"], "--bits 8: --format intk has 2, 3, 4 bits"),
    (["--format", "intk", "--symmetric"], "int4k is asymmetric only"),
    (["--method", "act-rtn", "--act-order"], "--act-order: a GPTQ setting"),
    (["--method", "act-rtn", "--format", "nf4"], "--method act-rtn makes qlite's int formats"),
])
def test_bad_flags_leave_nothing_behind(capsys, src, tmp_path, args, message):
    before = dir_digest(src)
    code, err = run_cli(capsys, "quantize", src, "--out", tmp_path / "dst", *args)
    assert code != 0 and len(err.strip().splitlines()) == 1 and message in err
    assert dir_digest(src) == before and list(tmp_path.iterdir()) == []


def test_int4k_from_the_cli(capsys, src, tmp_path):
    """--format intk: int4 groups of 32 (its default) with 8-bit scales, int8 lm_head and table as int's."""
    import shutil
    local = tmp_path / "ckpt"
    shutil.copytree(src, local)
    assert main(["quantize", str(local), "--format", "intk", "--no-report"]) == 0
    out = tmp_path / "ckpt-int4k-g32"
    assert main(["info", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "rtn int4k-g32, lm_head int8" in printed and "recipe         int4k-g32 x 14, int8 x 2" in printed
    assert "decoder linears 4.617 bits per weight" in printed  # 4 + 16 / 32 + a row scale over these narrow rows
    assert main(["generate", "-m", str(out), "-p", "the thin", "--max-new-tokens", "3"]) == 0
    assert main(["quantize", str(local), "--format", "intk", "--lm-head-bits", "4", "--embed-bits", "4",
                 "--no-report", "--out", str(tmp_path / "k4")]) == 0
    assert main(["info", str(tmp_path / "k4")]) == 0
    assert "rtn int4k-g32, lm_head int4k-g32, embeddings int4k-g32" in capsys.readouterr().out  # the same family


def test_act_rtn_from_the_cli(capsys, src, tmp_path):
    """--method act-rtn: calibrated, its own name in the default output dir and in info; it generates."""
    import shutil
    local = tmp_path / "ckpt"
    shutil.copytree(src, local)
    assert main(["quantize", str(local), "--method", "act-rtn", "--group-size", "64", "--nsamples", "2", "--seqlen", "32",
                 "--no-report"]) == 0
    out = tmp_path / "ckpt-act-rtn-int4-g64"
    assert main(["info", str(out)]) == 0
    assert "act-rtn int4-g64, lm_head int8" in capsys.readouterr().out
    assert main(["generate", "-m", str(out), "-p", "the thin", "--max-new-tokens", "3"]) == 0


def test_bitsandbytes_formats_from_the_cli(capsys, src, tmp_path):
    assert main(["quantize", str(src), "--format", "nf4", "--out", str(tmp_path / "nf4")]) == 0
    assert main(["info", str(tmp_path / "nf4")]) == 0
    out = capsys.readouterr().out
    assert "format         bnb nf4-b64, lm_head 16-bit" in out
    assert "decoder linears 4.500 bits per weight" in out  # absmax counted: 4 + 32/64
    assert main(["generate", "-m", str(tmp_path / "nf4"), "-p", "the thin", "--max-new-tokens", "3"]) == 0


def test_existing_destination_needs_force(capsys, src, tmp_path):
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "config.json").write_text("{}")  # a checkpoint dir: what --force may replace
    (tmp_path / "dst" / "keep.txt").write_text("mine")
    code, err = run_cli(capsys, "quantize", src, "--out", tmp_path / "dst")
    assert code != 0 and "already exists (use --force" in err
    assert (tmp_path / "dst" / "keep.txt").read_text() == "mine"
    assert run_cli(capsys, "quantize", src, "--out", tmp_path / "dst", "--group-size", "64", "--force")[0] == 0
    assert not (tmp_path / "dst" / "keep.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]


def test_source_missing_a_tensor(capsys, src, tmp_path):
    import shutil
    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.0.self_attn.k_proj.bias"]
    save_file(tensors, broken / "model.safetensors")
    before = dir_digest(broken)
    code, err = run_cli(capsys, "quantize", broken, "--out", tmp_path / "dst")
    assert code != 0 and "missing tensor model.layers.0.self_attn.k_proj.bias" in err
    assert dir_digest(broken) == before and not (tmp_path / "dst").exists()


def test_already_quantized_source_is_refused(src, tmp_path):
    out = convert(src, tmp_path / "q", bits=8, group_size=None, progress=False).out_dir
    with pytest.raises(QliteError, match="already quantized"):
        convert(out, tmp_path / "qq", bits=4)


def test_unknown_format_version_is_a_clear_error(capsys, src, tmp_path):
    out = convert(src, tmp_path / "q", bits=8, group_size=None, progress=False).out_dir
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["format_version"] = 99
    (out / "config.json").write_text(json.dumps(cfg))
    code, err = run_cli(capsys, "generate", "-m", out, "-p", "hi")
    assert code != 0 and "format_version 99 is unknown" in err
    cfg["quantization_config"] = {"quant_method": "awq"}
    (out / "config.json").write_text(json.dumps(cfg))
    assert "quantization method 'awq'" in run_cli(capsys, "info", out)[1]


def test_interrupt_mid_run_leaves_source_intact_and_no_output(tmp_path):
    """SIGINT while shards are being written: exit 130, one line, SRC unchanged, no DST or temp dir."""
    big = tmp_path / "big"
    big.mkdir()
    n_layers, h, inter = 40, 512, 1536
    config = {"model_type": "qwen2", "vocab_size": 1024, "hidden_size": h, "intermediate_size": inter,
              "num_hidden_layers": n_layers, "num_attention_heads": 8, "num_key_value_heads": 2,
              "max_position_embeddings": 128, "tie_word_embeddings": False}
    (big / "config.json").write_text(json.dumps(config))
    from qlite.config import ModelConfig
    from quantize.convert import expected_tensors
    shapes = expected_tensors(ModelConfig.from_dict(config))  # checkpoint names and shapes
    save_file({k: torch.randn(s).half() for k, s in shapes.items()}, big / "model.safetensors")
    before = dir_digest(big)
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "qlite", "quantize", str(big), "--out", str(out),
                             "--max-shard-size", "2MB"], stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while time.time() < deadline and not any(tmp_path.glob(".out.tmp-*/model-00002-*")):
        time.sleep(0.01)
    assert proc.poll() is None, "finished before it could be interrupted"
    os.kill(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "error: interrupted"
    assert "Traceback" not in err
    assert dir_digest(big) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big"]


@pytest.mark.parametrize("tensor, dtype", [("model.layers.0.mlp.down_proj.scales", torch.uint8),
                                           ("model.layers.0.mlp.down_proj.scales", torch.bfloat16),
                                           ("model.layers.1.self_attn.k_proj.qweight", torch.float32),
                                           ("model.layers.0.input_layernorm.weight", torch.int32)])
def test_stored_tensor_of_the_wrong_dtype_is_refused_before_any_kernel(capsys, src, tmp_path, tensor, dtype):
    out = convert(src, tmp_path / "q", bits=4, group_size=64, progress=False).out_dir
    tensors = load_file(out / "model.safetensors")
    tensors[tensor] = tensors[tensor].to(dtype)  # same shape, another dtype: what a kernel would misread
    save_file(tensors, out / "model.safetensors")
    code, err = run_cli(capsys, "generate", "-m", out, "-p", "the", "--max-new-tokens", "2")
    assert code != 0 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert f"tensor {tensor} is stored as" in err and "model.safetensors" in err


def test_force_never_replaces_the_source_or_what_holds_it(capsys, src, tmp_path):
    import shutil
    local = tmp_path / "models" / "ckpt"
    shutil.copytree(src, local)
    (tmp_path / "models" / "notes.txt").write_text("mine")
    before = dir_digest(tmp_path / "models")
    for out in (tmp_path / "models", local, tmp_path):
        code, err = run_cli(capsys, "quantize", local, "--out", out, "--force")
        assert code != 0 and len(err.strip().splitlines()) == 1, err
        assert "holds the input" in err or "is the input" in err or "lies inside the input" in err
    assert dir_digest(tmp_path / "models") == before


def test_force_replaces_only_a_checkpoint_dir(capsys, src, tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "keep.txt").write_text("mine")
    code, err = run_cli(capsys, "quantize", src, "--out", plain, "--force", "--group-size", "64")
    assert code != 0 and "--force replaces only a checkpoint dir" in err
    assert (plain / "keep.txt").read_text() == "mine"
    (tmp_path / "file").write_text("x")
    assert "--force replaces only" in run_cli(capsys, "quantize", src, "--out", tmp_path / "file", "--force")[1]


def test_links_out_of_the_source_and_odd_index_paths_are_refused(capsys, src, tmp_path):
    import shutil
    secret = tmp_path / "secret.txt"
    secret.write_text("do not copy me")
    local = tmp_path / "ckpt"
    shutil.copytree(src, local)
    (local / "README.md").symlink_to(secret)
    code, err = run_cli(capsys, "quantize", local, "--out", tmp_path / "dst", "--group-size", "64")
    assert code != 0 and "README.md: links to" in err and "outside the checkpoint dir" in err
    assert not (tmp_path / "dst").exists()
    (local / "README.md").unlink()
    (local / "notes.md").symlink_to(local / "tokenizer.json")  # a link that stays inside is fine
    assert run_cli(capsys, "quantize", local, "--out", tmp_path / "dst", "--group-size", "64")[0] == 0
    assert not (tmp_path / "dst" / "notes.md").is_symlink()
    os.rename(local / "model.safetensors", local / "weights.safetensors")
    for name in ("../ckpt/weights.safetensors", str(local / "weights.safetensors"), "fifo.safetensors"):
        (local / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": name}}))
        if name.startswith("fifo"):
            os.mkfifo(local / name)
        code, err = run_cli(capsys, "info", local)
        assert code != 0 and len(err.strip().splitlines()) == 1 and "model.safetensors.index.json" in err, err


@pytest.mark.parametrize("change, message", [
    ({"num_hidden_layers": 10 ** 9}, "num_hidden_layers is 1000000000, the tensors hold 2 layers"),
    ({"num_hidden_layers": 1}, "num_hidden_layers is 1, the tensors hold 2 layers"),
    ({"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 16}, "model.embed_tokens.weight is"),
])
def test_config_that_asks_for_more_than_the_files_hold(capsys, src, tmp_path, change, message):
    import shutil
    local = tmp_path / "ckpt"
    shutil.copytree(src, local)
    cfg = json.loads((local / "config.json").read_text())
    (local / "config.json").write_text(json.dumps({**cfg, **change}))
    for args in (["generate", "-m", local, "-p", "hi"], ["quantize", local, "--out", tmp_path / "q"]):
        code, err = run_cli(capsys, *args)
        assert code != 0 and len(err.strip().splitlines()) == 1 and message in err, err
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("args, message", [
    (["--max-shard-size", "0"], "--max-shard-size 0: not a positive size"),
    (["--max-shard-size", "-2GB"], "--max-shard-size -2GB"),
    (["--method", "gptq", "--seqlen", "100000"], "--seqlen 100000: longer than the model's context"),
])
def test_more_bad_quantize_flags(capsys, src, tmp_path, args, message):
    code, err = run_cli(capsys, "quantize", src, "--out", tmp_path / "dst", "--group-size", "64", *args)
    assert code != 0 and len(err.strip().splitlines()) == 1 and message in err, err
    assert list(tmp_path.iterdir()) == []


def test_bad_generate_and_eval_flags_fail_before_loading(capsys, src, tmp_path):
    code, err = run_cli(capsys, "generate", "-m", src, "-p", "hi", "--stop", "")
    assert code != 0 and "--stop" in err
    for args, message in ((["--max-chunks", "0"], "--max-chunks"), (["--json", tmp_path / "no" / "r.json"], "--json"),
                          (["--markdown", tmp_path], "--markdown")):
        code, err = run_cli(capsys, "eval", src, "--baseline", src, *args)
        assert code != 0 and len(err.strip().splitlines()) == 1 and message in err, err


def test_every_float_storage_dtype_is_a_source(tmp_path):
    """One table of float dtypes (checkpoint.FLOAT_STORAGE) for load, quantize and import: a float64
    checkpoint loads and quantizes like its float32 copy."""
    from qlite.checkpoint import FLOAT_STORAGE
    assert set(FLOAT_STORAGE) == {"F64", "F32", "F16", "BF16"}
    f32 = make_checkpoint(tmp_path / "f32", seed=5, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1)
    f64 = Path(__import__("shutil").copytree(f32, tmp_path / "f64"))
    save_file({k: v.double() for k, v in load_file(f32 / "model.safetensors").items()}, f64 / "model.safetensors",
              metadata={"format": "pt"})
    ids = torch.tensor([[5, 9, 77, 200]])
    a, b = (load_model(d, dtype="float32")(ids) for d in (f32, f64))
    assert torch.allclose(a, b, atol=1e-5)
    q32, q64 = (convert(d, tmp_path / f"{d.name}-q", bits=4, group_size=32, progress=False, report=False).out_dir
                for d in (f32, f64))
    w32, w64 = load_file(q32 / "model.safetensors"), load_file(q64 / "model.safetensors")
    codes = [k for k in w32 if k.endswith((".qweight", ".zeros"))]
    same = sum(torch.equal(w32[k], w64[k]) for k in codes)
    assert same == len(codes), f"{same}/{len(codes)}"
