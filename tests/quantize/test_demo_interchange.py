"""The demo int4 checkpoint through every export: bit-identical round trips, GGUF blocks as ggml reads
them, and transformers (GPTQModel) greedy tokens equal to qlite's reference teacher-forced."""
import json
import shutil

import numpy as np
import pytest
import torch

from eval.interchange import PROMPT, compare, transformers_run
from qlite.checkpoint import CheckpointDir
from qlite.tokenizer import Tokenizer
from qlite.formats import Int8
from quantize.interchange import export_checkpoint, import_checkpoint

pytestmark = pytest.mark.demo


@pytest.fixture(scope="module")
def exported(demo_int4, tmp_path_factory):
    """The demo int4 exported to GPTQ and compressed-tensors, and each imported back: {format: (the export's
    notes, its dir, the dir imported back)}, for the tests below (one export of each)."""
    out, done = tmp_path_factory.mktemp("exported"), {}
    for to in ("gptq", "compressed-tensors"):
        notes = export_checkpoint(demo_int4, to, out / to, progress=False)
        import_checkpoint(out / to, out / f"{to}-back", progress=False)
        done[to] = notes, out / to, out / f"{to}-back"
    yield done
    shutil.rmtree(out)  # four copies of the demo: not kept to the session's end


def test_demo_round_trips(demo_int4, exported):
    ours = CheckpointDir(demo_int4)
    zero_groups = sum(int((ours.read(n) == 0).sum()) for n in ours.tensors if n.endswith(".zeros"))
    assert zero_groups > 0  # the case GPTQ v1 cannot hold: auto writes v2
    for to, (notes, export_dir, back_dir) in exported.items():
        if to == "gptq":
            assert any("gptq_v2" in n for n in notes)
            assert json.loads((export_dir / "config.json").read_text())["quantization_config"][
                "checkpoint_format"] == "gptq_v2"
        back = CheckpointDir(back_dir)
        for name in ours.tensors:
            if to == "gptq" and name.startswith("lm_head.") or name.startswith("model.embed_tokens."):
                continue  # written float16: transformers' GPTQ loader, no quantized embeddings in either
            assert torch.equal(ours.read(name), back.read(name)), (to, name)
        table = {s: ours.read(f"model.embed_tokens.{s}") for s in ("qweight", "scales")}
        assert torch.equal(back.read("model.embed_tokens.weight"), Int8().dequantize(table, 896).half())


def test_demo_gguf_blocks(demo_int4, tmp_path):
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from qlite.loader import load_model

    export_checkpoint(demo_int4, "gguf", tmp_path / "m.gguf", progress=False)
    reader = GGUFReader(tmp_path / "m.gguf")
    model = load_model(demo_int4, dtype="float32", kernel="reference")
    modules = dict(model.named_modules())
    by_name = {t.name: t for t in reader.tensors}
    for gguf_name, module, tol in [("output.weight", "lm_head", 0.0), ("blk.5.ffn_down.weight",
                                                                        "model.layers.5.mlp.down_proj", 2e-3)]:
        t = by_name[gguf_name]
        w = dequantize(t.data, t.tensor_type).reshape(tuple(int(d) for d in reversed(t.shape)))
        ours = modules[module].dequantize().numpy()
        assert np.abs(w - ours).max() <= tol * np.abs(ours).max(), gguf_name
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == 151936


def test_demo_gptq_greedy_in_transformers(demo_int4, exported):
    pytest.importorskip("gptqmodel")
    _, export_dir, back = exported["gptq"]  # back: lm_head as transformers has it
    prompt = Tokenizer(demo_int4).encode(PROMPT)
    new, logits = transformers_run(export_dir, prompt, 16)
    row = compare(back, prompt, new, logits)
    assert row["same_tokens"], row
    assert row["max_abs_logit_diff"] < 0.5, row


def test_demo_gguf_greedy_in_llama_cpp(demo_int4, tmp_path):
    """With the bench extra (llama-cpp-python): llama.cpp's greedy tokens on the exported GGUF are
    qlite's (llama.cpp quantizes activations to 8 bits for its dot products, so they could differ
    where two logits are close; on this prompt they do not)."""
    pytest.importorskip("llama_cpp")
    from eval.interchange import llama_cpp_run

    export_checkpoint(demo_int4, "gguf", tmp_path / "m.gguf", progress=False)
    prompt = Tokenizer(demo_int4).encode(PROMPT)
    new, _ = llama_cpp_run(tmp_path / "m.gguf", prompt, 16)
    row = compare(demo_int4, prompt, new, None)
    assert row["same_tokens"], row
