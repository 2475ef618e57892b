"""qlite <-> compressed-tensors / GPTQ / GGUF: exact layouts (checked against each peer's own code or
its published dequantization formula), round trips, logits in transformers, and refused inputs."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from qlite.checkpoint import CheckpointDir
from qlite.cli import main
from qlite.errors import QliteError
from qlite.formats import Int4, Int8, format_named
from qlite.loader import load_model
from qlite.qconfig import QuantConfig
from qlite.qlinear import QuantLinear
from quantize import foreign
from quantize.convert import convert
from quantize.interchange import export_checkpoint, import_checkpoint
from tiny_models import NATIVE_WIDTHS, hf_model, make_checkpoint

QDIMS = dict(hidden_size=128, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2)
FORMATS = {  # name: quantize options (a 16-bit table: quantized embeddings have their own test)
    "int4-g32": dict(bits=4, group_size=32, embed_bits=16),
    "int4-g64-sym": dict(bits=4, group_size=64, symmetric=True, embed_bits=16),
    "int8": dict(bits=8, group_size=None, embed_bits=16),
    "int4-g32-head4": dict(bits=4, group_size=32, lm_head_bits=4, embed_bits=16),
}


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("isrc") / "ckpt", seed=7, **QDIMS)


@pytest.fixture(scope="module")
def quantized(src, tmp_path_factory):
    root = tmp_path_factory.mktemp("iq")
    return {name: convert(src, root / name, progress=False, **opts).out_dir for name, opts in FORMATS.items()}


def tensors(path: Path) -> dict[str, torch.Tensor]:
    ckpt = CheckpointDir(path)
    return {name: ckpt.read(name) for name in ckpt.tensors}


def logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return load_model(path, dtype="float32", kernel="reference")(ids).float()


IDS = torch.tensor([[3, 17, 250, 9, 100, 42, 7, 300, 12, 5]])


# --- pure layouts ------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("count", [8, 13, 64])
def test_words_round_trip(bits, count):
    u = torch.randint(0, 2 ** bits, (5, count), dtype=torch.uint8)
    words = foreign.pack_words(u, bits)
    assert words.dtype == torch.int32 and words.shape == (5, -(-count * bits // 32))
    assert torch.equal(foreign.unpack_words(words, bits, count), u)


@pytest.mark.parametrize("fmt", [Int4(32), Int4(64, True), Int8(None), Int8(32)], ids=str)
def test_compressed_tensors_layout_is_theirs(fmt):
    """Our packing equals compressed-tensors' own pack_to_int32 / unpack_from_int32, both ways."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    N, K = 48, 256
    stored = fmt.quantize(torch.randn(N, K))
    ct = foreign.to_compressed_tensors(fmt, stored, K, "x")
    u, _, zu = fmt.to_affine(stored, K)
    signed = (u.to(torch.int16) - 2 ** (fmt.bits - 1)).to(torch.int8)
    assert torch.equal(pack_to_int32(signed, fmt.bits), ct["weight_packed"])
    assert torch.equal(unpack_from_int32(ct["weight_packed"], fmt.bits, torch.Size([N, K])), signed)
    if not fmt.affine_symmetric:
        zp = (zu.to(torch.int16) - 8).to(torch.int8)
        assert torch.equal(pack_to_int32(zp, fmt.bits, packed_dim=0), ct["weight_zero_point"])
    back, order = foreign.from_compressed_tensors(fmt, ct, N, K, "x")
    assert order is None and all(torch.equal(back[k], stored[k]) for k in stored)


def gptq_dequantize(t: dict, bits: int, v1: bool) -> torch.Tensor:
    """GPTQ's published dequantization, written out here: w[n, k] = (q[k, n] - z[g[k], n]) * s[g[k], n]."""
    per_word = 32 // bits
    mask = 2 ** bits - 1
    qw = t["qweight"].to(torch.int64) & 0xFFFFFFFF
    q = torch.stack([(qw >> (bits * j)) & mask for j in range(per_word)], dim=1).reshape(-1, qw.shape[1])  # (K, N)
    qz = t["qzeros"].to(torch.int64) & 0xFFFFFFFF
    z = torch.stack([(qz >> (bits * j)) & mask for j in range(per_word)], dim=2).reshape(qz.shape[0], -1)  # (G, N)
    z = z + 1 if v1 else z
    g = t["g_idx"].long()
    return ((q - z[g]) * t["scales"].float()[g]).T  # (N, K)


@pytest.mark.parametrize("fmt", [Int4(32), Int4(64, True), Int8(None), Int8(64)], ids=str)
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_layout_dequantizes_as_gptq_does(fmt, act_order):
    N, K = 64, 256
    stored = fmt.quantize(torch.randn(N, K))
    stored["zeros"] = stored["zeros"].clamp(min=1) if "zeros" in stored else None
    stored = {k: v for k, v in stored.items() if v is not None}
    order = torch.randperm(K).int() if act_order else None
    want = fmt.dequantize(stored, K)  # stored column order
    if order is not None:
        want = foreign.original_columns(want, order)
    for v1 in (True, False):
        g = foreign.to_gptq(fmt, stored, K, order, v1, "x")
        assert torch.equal(gptq_dequantize(g, fmt.bits, v1), want)
        back, back_order = foreign.from_gptq(fmt, g, N, K, v1, "x")
        again = foreign.to_gptq(fmt, back, K, back_order, v1, "x")
        assert all(torch.equal(g[k], again[k]) for k in g)


def test_gptq_v1_refuses_zero_point_zero():
    fmt = Int4(32)
    stored = fmt.quantize(torch.randn(8, 64))
    stored["zeros"][0, 0] = 0
    with pytest.raises(Exception, match="zero point 0.*v2"):
        foreign.to_gptq(fmt, stored, 64, None, True, "layer")
    g = foreign.to_gptq(fmt, stored, 64, None, False, "layer")  # v2 holds it
    assert torch.equal(foreign.from_gptq(fmt, g, 8, 64, False, "layer")[0]["zeros"], stored["zeros"])


def test_g_idx_orders():
    g_idx = torch.tensor([1, 0, 1, 0, 2, 2])
    order = foreign.order_from_g_idx(g_idx, 2, "x")
    assert order.tolist() == [1, 3, 0, 2, 4, 5]
    assert torch.equal(foreign.g_idx_from_order(order, 6, 2), g_idx.int())
    assert foreign.order_from_g_idx(torch.tensor([0, 0, 1, 1]), 2, "x") is None
    for bad in ([0, 0, 0, 1], [0, 1, 2, 5]):
        with pytest.raises(Exception, match="not a permutation of 2 groups"):
            foreign.order_from_g_idx(torch.tensor(bad), 2, "x")


def test_gguf_blocks_dequantize_as_ggml_does():
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    N, K = 16, 256
    for fmt, kind, tol in [(Int8(None), "Q8_0", 0), (Int8(64), "Q8_0", 0), (Int4(64, True), "Q4_0", 0),
                           (Int4(32), "Q4_1", 2e-3)]:
        stored = fmt.quantize(torch.randn(N, K))
        got_kind, blocks = foreign.to_gguf_blocks(fmt, stored, K, "x")
        assert got_kind == kind
        w = dequantize(blocks.numpy(), getattr(GGMLQuantizationType, kind)).reshape(N, K)
        err = np.abs(w - fmt.dequantize(stored, K).numpy()).max()
        assert err <= tol * np.abs(w).max(), (fmt, err)
    with pytest.raises(Exception, match="32-weight GGUF blocks"):
        foreign.to_gguf_blocks(Int4(48), Int4(48).quantize(torch.randn(4, 96)), 96, "x")


# --- round trips through the files -----------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("to", ["compressed-tensors", "gptq"])
def test_export_import_round_trip(quantized, tmp_path, name, to):
    q = quantized[name]
    assert main(["export", str(q), "--to", to, "--out", str(tmp_path / "x")]) == 0
    assert main(["import", str(tmp_path / "x"), "--out", str(tmp_path / "back")]) == 0
    ours, back = tensors(q), tensors(tmp_path / "back")
    lm_head_16bit = to == "gptq"  # transformers' GPTQ loader cannot read a quantized head: written float16
    for name_, t in ours.items():
        if lm_head_16bit and name_.startswith("lm_head."):
            continue
        assert torch.equal(back[name_], t), name_
    if lm_head_16bit:
        head = load_model(q, dtype="float32", kernel="reference").lm_head.dequantize().half()
        assert torch.equal(back["lm_head.weight"], head)
    else:
        assert set(back) == set(ours)
    qkv = [f"model.layers.0.self_attn.{p}_proj.qweight" for p in "qkv"]
    assert CheckpointDir(tmp_path / "back").mapped(qkv) is not None  # written for the loader: back to back


@pytest.mark.parametrize("to", ["compressed-tensors", "gptq"])
def test_int4k_exports_as_the_int4_weights_it_stands_for(src, tmp_path, to):
    """int4k's 8-bit scale codes become the fp16 scales they make: imported back, an int4-g32 checkpoint
    whose every dequantized weight is the int4k one's."""
    q = convert(src, tmp_path / "k", scheme="intk", bits=4, group_size=32, embed_bits=16, progress=False,
                report=False).out_dir
    assert main(["export", str(q), "--to", to, "--out", str(tmp_path / "x")]) == 0
    assert main(["import", str(tmp_path / "x"), "--out", str(tmp_path / "back")]) == 0
    ours, back = load_model(q, dtype="float32", kernel="reference"), load_model(tmp_path / "back", dtype="float32",
                                                                              kernel="reference")
    theirs = dict(back.named_modules())
    for name, mod in ours.named_modules():
        if isinstance(mod, QuantLinear) and name != "lm_head":
            assert theirs[name].fmt.name == "int4-g32" and torch.equal(theirs[name].dequantize(), mod.dequantize()), name


def test_act_order_gptq_import_runs_and_round_trips(quantized, tmp_path):
    """An act-order GPTQ checkpoint (columns in groups by g_idx, one order per fused projection) is
    imported with qlite's input_order, runs like its GPTQ dequantization, and exports back the same."""
    gptq = tmp_path / "gptq"
    export_checkpoint(quantized["int4-g32"], "gptq", gptq, gptq_format="v2", progress=False)
    t = load_file(gptq / "model.safetensors")
    config = json.loads((gptq / "config.json").read_text())
    gen = torch.Generator().manual_seed(0)
    perms = {}
    for name in [n for n in t if n.endswith(".g_idx")]:
        module = name.removesuffix(".g_idx")
        shared = module.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj", "gate_proj")
        K = t[name].numel()
        perm = perms.setdefault(shared, torch.randperm(K, generator=gen))  # input column of each new column
        g_idx = t[name].long()
        # the act-order checkpoint: codes moved so input column perm[j] sits at row j's group slot
        q = unpack_gptq(t[f"{module}.qweight"])  # (K, N)
        new_q = torch.empty_like(q)
        new_q[perm] = q  # column k of the old layout becomes input column perm[k]
        new_g = torch.empty_like(g_idx)
        new_g[perm] = g_idx
        t[f"{module}.qweight"] = pack_gptq(new_q)
        t[name] = new_g.int()
    save_file(t, gptq / "model.safetensors", metadata={"format": "pt"})
    config["quantization_config"]["desc_act"] = True
    (gptq / "config.json").write_text(json.dumps(config))

    assert main(["import", str(gptq), "--out", str(tmp_path / "q")]) == 0
    qcfg = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert qcfg["input_order"] and qcfg["format_version"] == 2
    # the reference: the GPTQ file dequantized by its formula into a float checkpoint
    dense = tmp_path / "dense"
    shutil.copytree(gptq, dense)
    w = {}
    for name, tensor in t.items():
        if name.endswith(".qweight"):
            m = name.removesuffix(".qweight")
            parts = {s: t[f"{m}.{s}"] for s in ("qweight", "qzeros", "scales", "g_idx")}
            w[f"{m}.weight"] = gptq_dequantize(parts, 4, v1=False).contiguous()
        elif not name.endswith((".qzeros", ".scales", ".g_idx")):
            w[name] = tensor
    save_file(w, dense / "model.safetensors", metadata={"format": "pt"})
    config.pop("quantization_config")
    (dense / "config.json").write_text(json.dumps(config))
    want, got = hf_model(dense)(IDS).logits.detach(), logits(tmp_path / "q", IDS)
    assert (got - want).abs().max() < 1e-4
    # and back out: the same tensors as the act-order source
    export_checkpoint(tmp_path / "q", "gptq", tmp_path / "again", gptq_format="v2", progress=False)
    again = load_file(tmp_path / "again" / "model.safetensors")
    for name in t:
        assert torch.equal(again[name], t[name]), name


def unpack_gptq(qweight: torch.Tensor) -> torch.Tensor:
    return foreign.unpack_words(qweight.T, 4, qweight.shape[0] * 8).T  # (K, N)


def pack_gptq(codes: torch.Tensor) -> torch.Tensor:
    return foreign.pack_words(codes.T.contiguous(), 4).T.contiguous()


def test_fused_projections_need_one_order(quantized, tmp_path):
    gptq = tmp_path / "gptq"
    export_checkpoint(quantized["int4-g32"], "gptq", gptq, progress=False)
    t = load_file(gptq / "model.safetensors")
    name = "model.layers.0.self_attn.k_proj.g_idx"
    t[name] = t[name].flip(0).contiguous()  # a valid act-order g_idx for k alone
    save_file(t, gptq / "model.safetensors", metadata={"format": "pt"})
    r = run_cli("import", str(gptq), "--out", str(tmp_path / "q"))
    assert r.returncode == 1 and "k_proj and model.layers.0.self_attn.q_proj have different act-order" in r.stderr
    assert not (tmp_path / "q").exists()


# --- what other engines read --------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["int4-g64-sym", "int8"])
def test_compressed_tensors_export_runs_in_transformers(quantized, tmp_path, name):
    from transformers import AutoModelForCausalLM

    export_checkpoint(quantized[name], "compressed-tensors", tmp_path / "ct", progress=False)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "ct", dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = model(IDS).logits
    assert (theirs - logits(quantized[name], IDS)).abs().max() < 1e-4


def test_compressed_tensors_asymmetric_decompresses_as_theirs(quantized, tmp_path):
    """transformers cannot load asymmetric pack-quantized checkpoints yet (llm-compressor#1618, a
    zero-point shape mismatch at load); compressed-tensors' own decompressor reads ours exactly."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    export_checkpoint(quantized["int4-g32"], "compressed-tensors", tmp_path / "ct", progress=False)
    config = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    scheme = QuantizationScheme(targets=["Linear"], weights=config["config_groups"]["group_0"]["weights"])
    t = load_file(tmp_path / "ct" / "model.safetensors")
    model = load_model(quantized["int4-g32"], dtype="float32", kernel="reference")
    m = "model.layers.1.mlp.down_proj"
    parts = {k.removeprefix(m + "."): v for k, v in t.items() if k.startswith(m + ".") and "bias" not in k}
    weight = PackedQuantizationCompressor.decompress(parts, scheme)["weight"]
    assert torch.equal(weight, dict(model.named_modules())[m].dequantize().half())  # one fp16 rounding each


def test_gptq_export_runs_in_transformers(quantized, tmp_path):
    pytest.importorskip("gptqmodel")  # transformers' GPTQ path on the CPU (test extra)
    code = (  # one process for every export: importing transformers and gptqmodel is most of the time
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        "from safetensors.torch import save_file\n"
        "for src, dst in zip(sys.argv[1::2], sys.argv[2::2]):\n"
        "    m = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, device_map='cpu').eval()\n"
        "    assert 'gptqmodel' in type(m.model.layers[0].self_attn.q_proj).__module__\n"
        f"    ids = torch.tensor({IDS.tolist()})\n"
        "    w = m.model.layers[1].mlp.down_proj.dequantize_weight().T.float().contiguous()  # their (K, N)\n"
        "    with torch.no_grad(): save_file({'logits': m(ids).logits.float().contiguous(), 'w': w}, dst)\n")
    names = ("int4-g32", "int8")
    for name in names:
        export_checkpoint(quantized[name], "gptq", tmp_path / name, progress=False)
        import_checkpoint(tmp_path / name, tmp_path / f"{name}-back", progress=False)  # the same weights in qlite
    r = subprocess.run([sys.executable, "-c", code, *(str(tmp_path / f) for n in names for f in (n, f"{n}.st"))],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    for name in names:
        got = load_file(tmp_path / f"{name}.st")
        model = load_model(tmp_path / f"{name}-back", dtype="float32", kernel="reference")
        down = dict(model.named_modules())["model.layers.1.mlp.down_proj"].dequantize()
        assert torch.equal(got["w"], down.half().float())  # their dequantization: ours, rounded to float16
        # gptqmodel computes through float16 weights (int4 also float16 products): a tolerance
        assert (got["logits"] - logits(tmp_path / f"{name}-back", IDS)).abs().max() < (0.1 if "int4" in name else 1e-2)


def test_gguf_export(quantized, tmp_path):
    from gguf import GGUFReader
    from gguf.quants import dequantize

    out = tmp_path / "m.gguf"
    assert main(["export", str(quantized["int4-g64-sym"]), "--to", "gguf", "--out", str(out)]) == 0
    reader = GGUFReader(out)
    model = load_model(quantized["int4-g64-sym"], dtype="float32", kernel="reference")
    mods = dict(model.named_modules())
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == "Q4_0" and types["output.weight"] == "Q8_0"
    assert types["token_embd.weight"] in ("F16", "BF16", "F32") and types["blk.0.attn_norm.weight"] == "F32"
    for t in reader.tensors:
        if t.name in ("blk.1.ffn_down.weight", "output.weight"):
            w = dequantize(t.data, t.tensor_type).reshape(tuple(int(d) for d in reversed(t.shape)))
            module = "lm_head" if t.name == "output.weight" else "model.layers.1.mlp.down_proj"
            assert np.array_equal(w, mods[module].dequantize().numpy())
    fields = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    assert fields["tokenizer.ggml.tokens"][:3] == ["!", '"', "#"] and len(fields["tokenizer.ggml.tokens"]) == 512
    assert fields["tokenizer.ggml.tokens"][259] == "<|endoftext|>" or "<|im_end|>" in fields["tokenizer.ggml.tokens"]
    assert "im_start" in fields["tokenizer.chat_template"]
    # qlite reads it back (dequantized): the same logits up to the F16 embedding
    assert main(["import", str(out), "--out", str(tmp_path / "back")]) == 0
    assert (logits(tmp_path / "back", IDS) - logits(quantized["int4-g64-sym"], IDS)).abs().max() < 1e-2


@pytest.fixture(scope="module")
def shared_table(tmp_path_factory):
    """A tied model quantized with an int8 table that the int8 head shares (one stored copy); symmetric
    int4, which transformers loads from compressed-tensors."""
    root = tmp_path_factory.mktemp("shared")
    tied = make_checkpoint(root / "tied", seed=8, tie_word_embeddings=True, **QDIMS)
    return convert(tied, root / "q", bits=4, group_size=32, symmetric=True, embed_bits=8, progress=False).out_dir


def test_quantized_embeddings_export(shared_table, tmp_path):
    """compressed-tensors: the table as float16 (no quantized embeddings there), still tied; GGUF: the
    table as Q8_0 token_embd and no output.weight (llama.cpp's tied head), equal to qlite's table."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from transformers import AutoModelForCausalLM

    notes = export_checkpoint(shared_table, "compressed-tensors", tmp_path / "ct", progress=False)
    assert notes == ["embeddings (int8) written as float16: compressed-tensors stores no quantized embeddings"]
    assert json.loads((tmp_path / "ct" / "config.json").read_text())["tie_word_embeddings"] is True
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "ct", dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = model(IDS).logits
    assert (theirs - logits(shared_table, IDS)).abs().max() < 1e-2  # the table rounded to float16 once

    table = load_model(shared_table, dtype="float32", kernel="reference").model.embed_tokens
    dense = table.fmt.dequantize(table.stored(), table.embedding_dim)
    notes = export_checkpoint(shared_table, "gptq", tmp_path / "gptq", progress=False)
    assert notes[0] == "embeddings (int8) written as float16: GPTQ stores no quantized embeddings"
    assert torch.equal(load_file(tmp_path / "gptq" / "model.safetensors")["model.embed_tokens.weight"], dense.half())
    assert main(["export", str(shared_table), "--to", "gguf", "--out", str(tmp_path / "m.gguf")]) == 0
    found = {t.name: t for t in GGUFReader(tmp_path / "m.gguf").tensors}
    assert "output.weight" not in found and found["token_embd.weight"].tensor_type.name == "Q8_0"
    t = found["token_embd.weight"]
    w = dequantize(t.data, t.tensor_type).reshape(tuple(int(d) for d in reversed(t.shape)))
    assert np.array_equal(w, dense.numpy())


# --- refused ------------------------------------------------------------------------------------------

def run_cli(*args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                       os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "qlite", *args], capture_output=True, text=True, env=env, timeout=300)


def one_line_error(r, *needles):
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.fixture(scope="module")
def gptq_dir(quantized, tmp_path_factory):
    out = tmp_path_factory.mktemp("g") / "gptq"
    export_checkpoint(quantized["int4-g32"], "gptq", out, gptq_format="v2", progress=False)
    return out


def broken_copy(gptq_dir, tmp_path, config_change=None, tensor_change=None):
    bad = tmp_path / "bad"
    shutil.copytree(gptq_dir, bad)
    if config_change:
        config = json.loads((bad / "config.json").read_text())
        config_change(config["quantization_config"])
        (bad / "config.json").write_text(json.dumps(config))
    if tensor_change:
        t = load_file(bad / "model.safetensors")
        tensor_change(t)
        save_file(t, bad / "model.safetensors", metadata={"format": "pt"})
    return bad


@pytest.mark.parametrize("case,needles", [
    ("bits3", ["3-bit weights", "qlite reads 4 and 8 bits"]),
    ("group48", ["group_size 48 does not divide"]),
    ("g_idx", ["g_idx is not a permutation of 4 groups of 32 columns", "layers.0.self_attn.q_proj.g_idx"]),
    ("shape", ["tensor model.layers.1.mlp.up_proj.scales is F16 (2, 192), expected F16 (4, 192)"]),
    ("method", ["quant_method 'awq'", "qlite imports gptq, compressed-tensors"]),
    ("format", ["checkpoint_format 'marlin'"]),
])
def test_bad_gptq_checkpoints(gptq_dir, tmp_path, case, needles):
    changes = {
        "bits3": dict(config_change=lambda q: q.update(bits=3)),
        "group48": dict(config_change=lambda q: q.update(group_size=48)),
        "g_idx": dict(tensor_change=lambda t: t["model.layers.0.self_attn.q_proj.g_idx"].__setitem__(0, 1)),
        "shape": dict(tensor_change=lambda t: t.__setitem__("model.layers.1.mlp.up_proj.scales",
                                                            t["model.layers.1.mlp.up_proj.scales"][:2].clone())),
        "method": dict(config_change=lambda q: q.update(quant_method="awq")),
        "format": dict(config_change=lambda q: q.update(checkpoint_format="marlin")),
    }[case]
    bad = broken_copy(gptq_dir, tmp_path, **changes)
    before = {f.name: f.read_bytes() for f in bad.iterdir()}
    one_line_error(run_cli("import", str(bad), "--out", str(tmp_path / "out")), *needles)
    assert not (tmp_path / "out").exists() and [p.name for p in tmp_path.iterdir()] == ["bad"]
    assert {f.name: f.read_bytes() for f in bad.iterdir()} == before


def test_foreign_checkpoint_is_named_at_load(gptq_dir):
    one_line_error(run_cli("generate", "-m", str(gptq_dir), "--prompt", "hi", "--max-new-tokens", "1"),
                   "quantization method 'gptq'", "qlite import")


def test_a_mix_of_formats_exports_per_module(src, tmp_path):
    """A --target-bpw checkpoint: compressed-tensors gets a group per format naming its modules (each
    decompresses as qlite dequantizes), GGUF a block type per tensor, GPTQ (one format) refuses."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from gguf import GGUFReader
    from gguf.quants import dequantize

    mixed = (("model.layers.0.mlp.down_proj", format_named("int8")), ("model.layers.1.mlp.down_proj", None),
             ("model.layers.1.self_attn.o_proj", format_named("int8-g32")),
             ("model.layers.0.self_attn.o_proj", format_named("int4k-g32")))  # its coded scales export as fp16 ones
    qconfig = QuantConfig(format_named("int4-g64"), format_named("int8"), embeddings=None, module_formats=mixed)
    q = convert(src, tmp_path / "mix", qconfig, progress=False, report=False).out_dir
    stored, widths = CheckpointDir(q), CheckpointDir(src).tensors

    def dequantized(m):  # what qlite runs for checkpoint module m
        fmt = qconfig.format_for(m)
        return fmt.dequantize({s: stored.read(f"{m}.{s}") for s in fmt.stored_shapes(1, 1)},
                              widths[f"{m}.weight"].shape[1])
    export_checkpoint(q, "compressed-tensors", tmp_path / "ct", progress=False)
    config = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    groups = {tuple(g["targets"]): g["weights"] for g in config["config_groups"].values()}
    assert groups[("model.layers.0.mlp.down_proj",)]["strategy"] == "channel"
    assert groups[("model.layers.1.self_attn.o_proj",)]["group_size"] == 32
    assert groups[("model.layers.0.self_attn.o_proj",)]["group_size"] == 32
    assert "model.layers.1.mlp.down_proj" in config["ignore"]
    t = load_file(tmp_path / "ct" / "model.safetensors")
    for targets, weights in groups.items():
        m = targets[0]
        parts = {k.removeprefix(m + "."): v for k, v in t.items() if k.startswith(m + ".") and "bias" not in k}
        got = PackedQuantizationCompressor.decompress(parts, QuantizationScheme(targets=["Linear"], weights=weights))
        assert torch.equal(got["weight"], dequantized(m).half()), m
    assert sum(len(targets) for targets in groups) == 2 * 7 - 1 + 1  # every quantized linear once, and lm_head
    export_checkpoint(q, "gguf", tmp_path / "m.gguf", progress=False)
    blocks = {r.name: r for r in GGUFReader(tmp_path / "m.gguf").tensors}
    for name, module in (("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj"),
                         ("blk.1.attn_output.weight", "model.layers.1.self_attn.o_proj"),
                         ("blk.0.ffn_up.weight", "model.layers.0.mlp.up_proj"),
                         ("blk.0.attn_output.weight", "model.layers.0.self_attn.o_proj")):
        r = blocks[name]
        w = dequantize(r.data, r.tensor_type).reshape(tuple(int(d) for d in reversed(r.shape)))
        exact = "up" not in name and name != "blk.0.attn_output.weight"  # int8 -> Q8_0 is exact; asymmetric int4 -> Q4_1 stores -zero * scale in fp16
        assert np.abs(w - dequantized(module).numpy()).max() <= (0 if exact else 2.5e-4), (name, np.abs(w - dequantized(module).numpy()).max())
    assert blocks["blk.1.ffn_down.weight"].tensor_type.name in ("BF16", "F16", "F32")
    with pytest.raises(QliteError, match="a mix of formats .* a GPTQ config holds one"):
        export_checkpoint(q, "gptq", tmp_path / "gptq", progress=False)
    assert not (tmp_path / "gptq").exists()
    back_config = import_checkpoint(tmp_path / "ct", tmp_path / "back", progress=False)  # the mix imports back
    back = CheckpointDir(tmp_path / "back")
    for m in [m for m, _ in mixed] + ["model.layers.0.mlp.up_proj", "lm_head"]:
        fmt = back_config.format_for(m)
        assert (fmt is None) == (qconfig.format_for(m) is None), m
        if fmt is None:
            assert torch.equal(back.read(f"{m}.weight"), stored.read(f"{m}.weight")), m
        else:  # the same numbers (int4k's coded scales come back as the fp16 scales they stand for: int4-g32)
            got = fmt.dequantize({s: back.read(f"{m}.{s}") for s in fmt.stored_shapes(1, 1)}, widths[f"{m}.weight"].shape[1])
            assert torch.equal(got, dequantized(m)), m
    assert back_config.format_for("model.layers.0.self_attn.o_proj").name == "int4-g32"


def test_bad_exports(quantized, src, tmp_path):
    one_line_error(run_cli("export", str(src), "--to", "gptq", "--out", str(tmp_path / "a")), "a 16-bit checkpoint")
    bad_v1 = quantized["int4-g32"]
    zeros_zero = any((CheckpointDir(bad_v1).read(n) == 0).any() for n in CheckpointDir(bad_v1).tensors
                     if n.endswith(".zeros"))
    if zeros_zero:
        one_line_error(run_cli("export", str(bad_v1), "--to", "gptq", "--gptq-format", "v1", "--out",
                               str(tmp_path / "b")), "--gptq-format v1", "zero point 0")
    r = run_cli("export", str(bad_v1), "--to", "onnx", "--out", str(tmp_path / "c"))
    assert r.returncode == 2 and "'--to'" in r.stderr and "Traceback" not in r.stderr
    (tmp_path / "d.gguf").write_text("not a gguf")
    one_line_error(run_cli("export", str(bad_v1), "--to", "gguf", "--out", str(tmp_path / "d.gguf"), "--force"),
                   "--force replaces only")
    assert (tmp_path / "d.gguf").read_text() == "not a gguf"
    one_line_error(run_cli("export", str(bad_v1), "--to", "gguf", "--out", str(bad_v1 / "m.gguf")), "inside")
    assert not (bad_v1 / "m.gguf").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.gguf"]
    for _ in range(2):  # a GGUF file is replaced with --force
        assert main(["export", str(bad_v1), "--to", "gguf", "--out", str(tmp_path / "e.gguf"), "--force"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.gguf", "e.gguf"]


def test_gptq_settings_in_quantize_config_json(gptq_dir, quantized, tmp_path):
    """Older GPTQ checkpoints keep their settings in quantize_config.json beside config.json."""
    old = tmp_path / "old"
    shutil.copytree(gptq_dir, old)
    config = json.loads((old / "config.json").read_text())
    settings = config.pop("quantization_config")
    settings.pop("quant_method")
    (old / "config.json").write_text(json.dumps(config))
    (old / "quantize_config.json").write_text(json.dumps(settings))
    import_checkpoint(old, tmp_path / "q", progress=False)
    assert not (tmp_path / "q" / "quantize_config.json").exists()
    ours, back = tensors(quantized["int4-g32"]), tensors(tmp_path / "q")
    assert all(torch.equal(back[n], t) for n, t in ours.items() if not n.startswith("lm_head."))


def test_a_rotated_checkpoint_is_refused_by_every_export_in_one_line(tmp_path, capsys):
    """int3h / int4h store W R: no peer format rotates, so no export holds them (nor writes a file)."""
    src = make_checkpoint(tmp_path / "src", seed=5, **NATIVE_WIDTHS)
    q = convert(src, tmp_path / "h", scheme="inth", bits=3, progress=False, report=False).out_dir
    capsys.readouterr()
    for target in ("gguf", "compressed-tensors", "gptq"):
        assert main(["export", str(q), "--to", target, "--out", str(tmp_path / f"x.{target}")]) != 0
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and ("is int3h-g128" in err or "format int3h-g128: no exact encoding" in err), err
        assert not (tmp_path / f"x.{target}").exists()
