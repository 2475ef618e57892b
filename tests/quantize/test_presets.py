"""Every preset and budget, on tied and untied tiny models of widths int4-g128 divides, dense and mixtures
of experts (at widths it does
not divide the presets fall back to 8 bits, which hid a broken tied int4 table): quantize with its report,
load, generate, serve one request, eval, and each export read back."""
import json

import pytest
import torch

from cli_checks import assert_one_line_error, run_cli
from qlite.checkpoint import CheckpointDir
from qlite.loader import load_model
from qlite.pipeline import load
from qlite.serve.engine import Engine
from quantize.presets import PRESETS
from tiny_models import MOE, NATIVE_WIDTHS, make_checkpoint

from .test_convert import dequantized_twin

RECIPES = {**{name: ["--preset", name] for name in PRESETS},
           "target-bpw": ["--target-bpw", "4.5"], "target-kld": ["--target-kld", "0.25"],
           "int3k": ["--format", "intk", "--bits", "3"],
           "int2k-gptq": ["--format", "intk", "--bits", "2", "--group-size", "16", "--method", "gptq", "--seqlen", "128"]}
# else int4 somewhere (q8: int8 may be all); the sub-4-bit presets' budgets need int3k or int2k somewhere
LINEAR_FORMAT = {"int3k": ("int3k-g32",), "int2k-gptq": ("int2k-g16",), "q3": ("int3k",), "q2": ("int3k", "int2k")}
IDS = torch.tensor([[3, 17, 250, 9, 100, 42, 7, 300, 12, 5]])


@pytest.fixture(scope="module", params=["tied", "untied", "qwen2_moe", "qwen3_moe-tied"])
def source(request, tmp_path_factory):
    model_type = request.param.removesuffix("-tied")
    widths = MOE.get(model_type, NATIVE_WIDTHS)
    return make_checkpoint(tmp_path_factory.mktemp(request.param) / "src", seed=11,
                           model_type=model_type if model_type in MOE else "qwen2",
                           **dict(widths, tie_word_embeddings=request.param.endswith("tied")))


@pytest.fixture(scope="module", params=sorted(RECIPES))
def quantized(request, source):
    """(source, quantized dir) made by `qlite quantize` with the recipe's flags, its report measured."""
    from qlite.cli import main
    out = source.parent / request.param
    assert main(["quantize", str(source), "--out", str(out), *RECIPES[request.param]]) == 0
    return source, out


def reference_logits(path) -> torch.Tensor:
    with torch.no_grad():
        return load_model(path, dtype="float32", kernel="reference")(IDS).float()


def test_loads_runs_and_reports(quantized):
    """The checkpoint loads as the runtime loads it (the report measured it that way), its tied head
    shares the loaded table when both have one format, and its logits are its dequantized twin's."""
    src, out = quantized
    report = json.loads((out / "quantization_report.json").read_text())
    assert report["fidelity"]["texts"]["code"]["kld_mean"] < 1.0
    q, twin = dequantized_twin(out, src)
    qcfg = q.config.quantization
    linear_formats = {qcfg.linear.name} | {f.name for _, f in qcfg.module_formats if f is not None}
    assert any(name.startswith(LINEAR_FORMAT.get(out.name, ("int4",))) for name in linear_formats) or "q8" in out.name
    if out.name in PRESETS:  # a preset mixes nothing below its least bits (q4, q4-gptq, q8: int4; q3: int3k)
        formats = {qcfg.linear, qcfg.lm_head, qcfg.embeddings, *(f for _, f in qcfg.module_formats)} - {None}
        assert min(f.bits for f in formats) >= PRESETS[out.name].least_bits
    if q.config.tie_word_embeddings and qcfg.shares_table(True) and qcfg.embeddings is not None:
        table, head = q.model.embed_tokens.stored(), q.lm_head.stored()
        assert table.keys() == head.keys() and all(head[k] is table[k] for k in table)
    with torch.no_grad():
        assert torch.allclose(q(IDS), twin(IDS), atol=1e-4, rtol=1e-4)
    assert torch.isfinite(load_model(out)(IDS)).all()  # default dtype and kernels


def test_generate_and_eval(quantized, capsys):
    src, out = quantized
    code, text, _ = run_cli(capsys, "info", out)
    stored, source = CheckpointDir(out), CheckpointDir(src)
    params = sum(torch.Size(t.shape).numel() for t in source.tensors.values())  # a tied table counted once
    assert code == 0 and f"parameters     {params:,} " in text
    assert f"tensor bytes   {sum(t.nbytes for t in stored.tensors.values()):,} " in text
    code, text, _ = run_cli(capsys, "generate", "-m", out, "-p", "the", "--max-new-tokens", "6", "--temperature", "0")
    assert code == 0 and text
    code, table, err = run_cli(capsys, "eval", out, "--baseline", src, "--ctx", "64", "--max-chunks", "2")
    assert code == 0, err
    row = next(line for line in table.splitlines() if line.startswith(f"| {out.name} ") and "| code |" in line)
    assert "nan" not in row.lower()


def test_serves_one_request_as_the_python_api_answers(quantized):
    from tests.qlite.serve.test_server import call, running
    lm = load(quantized[1])
    want = lm.generate("the he", chat=False, max_new_tokens=8)
    with running(lm, Engine(lm, max_batch=2, ctx=128, max_queue=2).start()) as (port, _):
        status, payload = call(port, "/v1/completions", {"prompt": "the he", "max_tokens": 8})
    assert status == 200 and json.loads(payload)["choices"][0]["text"] == want


@pytest.mark.parametrize("to", ["compressed-tensors", "gptq", "gguf"])
def test_exports_read_back(quantized, tmp_path, capsys, to):
    """Each export imported back runs with the quantized model's logits (a format no peer holds exactly is
    refused in one line): exactly where the weights travel as they are, up to float16 where an export rounds a table or head to it (GGUF's import
    dequantizes to float16). GPTQ holds one format: a mix is refused in one line; so is a GGUF of a mixture
    of experts with dense layers among its sparse ones, which llama.cpp cannot hold."""
    _, out = quantized
    x = tmp_path / ("m.gguf" if to == "gguf" else "x")
    code, _, err = run_cli(capsys, "export", out, "--to", to, "--out", x)
    cfg = CheckpointDir(out).config
    q = cfg.quantization
    low = sorted({f.name for f in (q.linear, q.lm_head, *(f for _, f in q.module_formats)) if f is not None and not f.exports})
    if low:  # below 4 bits: no peer format holds qlite's grid exactly
        assert_one_line_error(code, err, " is int", "; ", "int4 and int8")
        assert any(f" is {name}" in err for name in low), err
        return
    if to == "gptq" and cfg.quantization.module_formats:
        assert_one_line_error(code, err, "a mix of formats")
        return
    if to == "gguf" and cfg.experts is not None and cfg.experts.dense_layers:
        assert_one_line_error(code, err, "llama.cpp's qwen2moe makes every layer sparse")
        return
    assert code == 0, err
    code, _, err = run_cli(capsys, "import", x, "--out", tmp_path / "back")
    assert code == 0, err
    diff = (reference_logits(tmp_path / "back") - reference_logits(out)).abs().max()
    assert diff < 2e-2, diff


def test_a_checkpoint_the_runtime_refuses_is_never_written(source, tmp_path, capsys, monkeypatch):
    """quantize loads what it wrote as the runtime does, with or without a report: a stored value the
    format does not allow (here an int4 zero point of 16) fails there, and no output is left."""
    import quantize.convert as convert

    def bad_zeros(src, job):
        stored = real(src, job)
        if "zeros" in stored:
            stored = {**stored, "zeros": torch.full_like(stored["zeros"], 16)}
        return stored

    real = convert.quantize_tensor
    monkeypatch.setattr(convert, "quantize_tensor", bad_zeros)
    code, _, err = run_cli(capsys, "quantize", source, "--out", tmp_path / "q", "--preset", "fast", "--no-report")
    assert_one_line_error(code, err.splitlines()[-1], f"{tmp_path / 'q'}: not written", "zero point 16")
    assert ".tmp" not in err and not (tmp_path / "q").exists()


def test_q4_reads_coding_conversations_where_the_model_has_a_chat_template(quantized, tmp_path):
    """The default preset's sensitivities come from `chat` windows (coding conversations in the model's
    template); a source without a template gets the plain built-in text instead of an error."""
    src, out = quantized
    if out.name != "q4":
        pytest.skip("the q4 preset")
    assert json.loads((out / "config.json").read_text())["quantization_config"]["sensitivity"]["data"] == "chat"
    from quantize.presets import quantize_preset
    bare = make_checkpoint(tmp_path / "bare", seed=11, **NATIVE_WIDTHS)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    (bare / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "chat_template"}))
    summary = quantize_preset("q4", bare, tmp_path / "bare-q4", report=False, progress=False)
    assert json.loads((summary.out_dir / "config.json").read_text())["quantization_config"]["sensitivity"]["data"] == "builtin"


def test_a_source_without_a_tokenizer_gets_fast_with_a_note(tmp_path, capsys):
    """The default's mix is chosen by measuring text, which needs the tokenizer: without tokenizer.json
    `qlite quantize SRC` says so and writes the fast preset (int4-g128, no measurement)."""
    src = make_checkpoint(tmp_path / "src", seed=13, **NATIVE_WIDTHS)
    (src / "tokenizer.json").unlink()
    code, _, err = run_cli(capsys, "quantize", src)
    assert code == 0 and f"note: {src} has no tokenizer.json to measure a mix with; writing --preset fast" in err
    assert json.loads((tmp_path / "src-fast" / "config.json").read_text())["quantization_config"]["preset"] == "fast"
