"""Will it fit (fit.py): the KV cache and weight bytes it counts are what a loaded model allocates, the
longest context is the boundary of what fits, and generate / chat / serve refuse a run that cannot fit
in one line, up front; `qlite info --ctx` prints the need and the verdict."""
import pytest

from cli_checks import assert_one_line_error, run_cli
from qlite import fit
from qlite.checkpoint import CheckpointDir
from qlite.loader import load_model
from qlite.decoder.causal_lm import CausalLM
from tiny_models import make_checkpoint


@pytest.fixture(scope="module")
def ckpt32(tmp_path_factory):
    """A tiny checkpoint whose head_dim (32) a quantized cache takes, and its int4 quantization."""
    from quantize.convert import convert
    src = make_checkpoint(tmp_path_factory.mktemp("fit") / "bf16", hidden_size=128, intermediate_size=192)
    return src, convert(src, src.parent / "int4", bits=4, group_size=32, progress=False, report=False).out_dir


@pytest.mark.parametrize("kv_cache", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_kv_cache_and_weight_bytes_are_what_a_loaded_model_holds(ckpt32, kv_cache, dtype):
    for path in ckpt32:
        model = load_model(path, dtype=dtype, kv_cache=kv_cache)
        cache = model.new_cache(3, 50)
        dtype_bytes = model.dtype.itemsize
        assert fit.kv_cache_bytes(model.config, 50, 3, model.kv_bits, dtype_bytes) == cache.nbytes
        held = {t.data_ptr(): t.numel() * t.element_size() for t in model.state_dict().values()}
        assert fit.weight_bytes(CheckpointDir(path), dtype_bytes) == sum(held.values())
        table = {t.data_ptr(): t.numel() * t.element_size() for t in model.model.embed_tokens.state_dict().values()}
        resident = fit.need(CheckpointDir(path), 50, dtype=model.dtype).weights  # own lm_head: the table is left out
        assert resident == sum(held.values()) - sum(table.values())


def test_the_longest_context_is_the_boundary_of_what_fits(ckpt32):
    ckpt = CheckpointDir(ckpt32[1])
    available = fit.need(ckpt, 100, kv_bits=8).total + 1000
    longest = fit.longest_context(ckpt, available, kv_bits=8)
    assert fit.need(ckpt, longest, kv_bits=8).total <= available < fit.need(ckpt, longest + 1, kv_bits=8).total
    assert fit.longest_context(ckpt, available, kv_bits=4) > longest > fit.longest_context(ckpt, available, kv_bits=16)
    assert fit.longest_context(ckpt, 10) == 0
    assert fit.longest_context(ckpt, 2**50) == ckpt.config.context_length
    assert fit.PREFILL_CHUNK == CausalLM.prefill_chunk


def test_generate_chat_and_serve_refuse_a_run_that_cannot_fit(ckpt32, capsys, monkeypatch):
    path = ckpt32[1]
    ckpt = CheckpointDir(path)
    # room for 252 tokens (prompt and reply) with an int8 cache, not with a bf16 one
    monkeypatch.setattr(fit, "available_here", lambda: fit.need(ckpt, 252, kv_bits=8).total)
    code, _, err = run_cli(capsys, "generate", "-m", path, "-p", "hi", "--raw", "--max-new-tokens", 250)
    assert_one_line_error(code, err, "--max-new-tokens:", "tokens need", "the longest context that fits is",
                          "--kv-cache")
    assert run_cli(capsys, "generate", "-m", path, "-p", "hi", "--raw", "--max-new-tokens", 250, "--kv-cache",
                   "int8")[0] == 0  # an int8 cache fits
    code, _, err = run_cli(capsys, "chat", "-m", path, "--ctx", 252)
    assert_one_line_error(code, err, "--ctx: 252 tokens need")
    code, _, err = run_cli(capsys, "serve", "-m", path, "--ctx", 100, "--max-batch", 4, "--port", 0)
    assert_one_line_error(code, err, "--ctx: 4 x 100 tokens need")


def test_info_ctx_prints_the_need_and_the_verdict(ckpt32, capsys):
    code, out, _ = run_cli(capsys, "info", ckpt32[1], "--ctx", 1000, "--batch", 2, "--kv-cache", "int8")
    assert code == 0
    memory, verdict = out.strip().splitlines()[-2:]
    assert memory.startswith("memory         2 x 256 tokens, KV cache int8: ")  # the tiny model's context
    assert "(the model's context is 256)" in memory and "weights" in memory and "kv cache" in memory
    assert verdict.startswith("fits here      yes: ") and "(the whole 256)" in verdict
    assert "memory" not in run_cli(capsys, "info", ckpt32[1])[1]


def test_a_tensor_converted_at_load_counts_its_file_pages_once(ckpt32):
    """A float32 checkpoint run in bf16 converts every float tensor: the largest one's file pages and
    its copy are both resident while it converts; run as stored, nothing is converted."""
    import torch

    ckpt = CheckpointDir(ckpt32[0])
    largest = max(t.nbytes for t in ckpt.tensors.values())
    assert fit.load_transient_bytes(ckpt, "BF16") == largest and fit.load_transient_bytes(ckpt, "F32") == 0
    assert fit.need(ckpt, 10, dtype=torch.bfloat16).scratch == largest  # 16-bit: no dequantized gate|up
    assert fit.need(ckpt, 10, dtype=torch.float32).scratch == 0


def test_the_scratch_is_the_largest_linear_a_prefill_dequantizes(ckpt32, monkeypatch):
    """int4 layers the integer-activation product takes (gate|up: 128 wide) dequantize nothing; down (192
    wide: not whole chunks of 128) is dequantized to bf16. Without that product, gate|up is the largest."""
    from qlite import native
    ckpt = CheckpointDir(ckpt32[1])
    down, gate_up = 2 * 128 * 192, 2 * 2 * 192 * 128
    monkeypatch.setattr(native, "vnni_ready", lambda: True)
    assert fit.scratch_bytes(ckpt.config) == down
    monkeypatch.setattr(native, "vnni_ready", lambda: False)
    assert fit.scratch_bytes(ckpt.config) == gate_up
    assert fit.scratch_bytes(CheckpointDir(ckpt32[0]).config) == 0


def test_int8_layers_dequantize_for_a_prefill_only_where_the_integer_product_cannot_take_them(ckpt32, tmp_path,
                                                                                                monkeypatch):
    """int8 weights: the integer-activation product runs at every row count, so only down (192 wide: not
    whole chunks) is dequantized; without that product, gate|up is too."""
    from qlite import native
    from quantize.convert import convert
    int8 = CheckpointDir(convert(ckpt32[0], tmp_path / "int8", bits=8, progress=False, report=False).out_dir)
    down, gate_up = 2 * 128 * 192, 2 * 2 * 192 * 128
    monkeypatch.setattr(native, "vnni_ready", lambda: True)
    assert fit.scratch_bytes(int8.config) == down
    monkeypatch.setattr(native, "vnni_ready", lambda: False)
    assert fit.scratch_bytes(int8.config) == gate_up
