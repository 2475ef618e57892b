"""Rope scalings (qlite/arch/rope.py) against transformers: the frequencies and attention factor of a
Qwen2.5 long-context config (YaRN) equal transformers' own computation, and tiny Qwen2 / Qwen3 models
with YaRN, linear or dynamic NTK scaling give transformers' logits, past the original context too."""
import json

import pytest
import torch

from arch_checks import assert_gguf_round_trip, assert_greedy_matches, assert_logits_match
from qlite.checkpoint import CheckpointDir
from qlite.config import ModelConfig
from qlite.decode import generate_tokens
from qlite.errors import QliteError
from qlite.generate import SamplingParams
from qlite.loader import load_model
from qlite.decoder.layers import Rotary
from quantize.gguf_export import export_gguf
from tiny_models import hf_model, make_checkpoint

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}  # the tiny context is past it
LINEAR = {"rope_type": "linear", "factor": 2.0}


@pytest.mark.parametrize("scaling", [
    {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},  # Qwen2.5-7B-Instruct's README
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096, "beta_fast": 16, "truncate": False},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192, "mscale": 1.0, "mscale_all_dim": 0.5},
    {"rope_type": "linear", "factor": 4.0},
], ids=["qwen2.5-yarn", "yarn-no-truncate", "yarn-mscale", "linear"])
def test_frequencies_equal_transformers(scaling):
    from transformers import Qwen2Config as HFConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    base = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768, rope_theta=1e6)
    ours = Rotary(ModelConfig.from_dict({"model_type": "qwen2", **base, "rope_scaling": scaling}))
    hf = HFConfig(**base, rope_scaling=dict(scaling))
    hf.standardize_rope_params()
    inv_freq, factor = ROPE_INIT_FUNCTIONS[hf.rope_parameters["rope_type"]](hf, "cpu")
    assert torch.allclose(ours.inv_freq, inv_freq.float(), rtol=1e-6, atol=0)
    assert ours.attention_factor == pytest.approx(factor, rel=1e-12)


@pytest.mark.parametrize("model_type, scaling", [("qwen2", YARN), ("qwen2", LINEAR), ("qwen3", YARN)])
def test_logits_and_greedy_match_transformers(tmp_path, model_type, scaling):
    extra = {"head_dim": 32} if model_type == "qwen3" else {}
    path = make_checkpoint(tmp_path / "ckpt", model_type=model_type, rope_scaling=dict(scaling), **extra)
    assert_logits_match(path)
    assert_greedy_matches(path, n=40)


@pytest.mark.parametrize("seq_len", [100, 32768, 40000, 131072])
def test_dynamic_frequencies_equal_transformers(seq_len):
    """Dynamic NTK's per-length frequencies: the unscaled ones up to the context, then transformers'."""
    from transformers import Qwen2Config as HFConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    base = dict(vocab_size=1000, hidden_size=3584, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768, rope_theta=1e6)
    scaling = {"rope_type": "dynamic", "factor": 4.0}
    ours = Rotary(ModelConfig.from_dict({"model_type": "qwen2", **base, "rope_scaling": scaling}))
    hf = HFConfig(**base, rope_scaling=dict(scaling))
    hf.standardize_rope_params()
    inv_freq, _ = ROPE_INIT_FUNCTIONS["dynamic"](hf, "cpu", seq_len=torch.tensor(seq_len))
    positions = torch.tensor([[0, seq_len - 1], [0, 7]])  # row 0 seq_len long, row 1 short: unscaled
    cos, _ = ours(positions)  # (B, 1, T, head_dim)
    expected = torch.outer(torch.tensor([0.0, seq_len - 1]), inv_freq.float()).cos()  # (T, head_dim/2)
    assert torch.allclose(cos[0, 0, :, :64], expected, rtol=0, atol=1e-6)
    plain = Rotary(ModelConfig.from_dict({"model_type": "qwen2", **base}))
    assert torch.equal(cos[1], plain(positions[1:])[0][0])


def test_dynamic_generation_equals_transformers_with_its_cache(tmp_path):
    """Past the context, each new token's frequencies come from the length so far while the cached keys
    keep theirs: transformers' generate (with its KV cache) does the same, token for token."""
    path = make_checkpoint(tmp_path / "ckpt", max_position_embeddings=16,
                           rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    assert_logits_match(path)  # one 23-token forward, past the 16-token context
    ours, ref = load_model(path, dtype="float32"), hf_model(path)
    prompt = [5, 17, 99, 3, 250, 41, 7, 8, 9, 10, 11, 12]
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, min_new_tokens=20)
    got = [int(t[0]) for t in generate_tokens(ours, [prompt], SamplingParams(max_new_tokens=30), eos_ids=())]
    assert got == want[0, len(prompt):].tolist()  # 20: as far as factor x 16 allows


def test_dynamic_is_refused_by_gguf_export(tmp_path):
    path = make_checkpoint(tmp_path / "ckpt", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(QliteError, match="rope scaling dynamic: llama.cpp's GGUF has no key"):
        export_gguf(CheckpointDir(path), tmp_path / "out.gguf", force=False, progress=False)
    assert not (tmp_path / "out.gguf").exists()


def test_gguf_carries_the_scaling_both_ways(tmp_path):
    """export --to gguf writes llama.cpp's rope scaling keys; import-gguf reads them back into the config."""
    path = make_checkpoint(tmp_path / "ckpt", rope_scaling=dict(YARN))
    assert_gguf_round_trip(path, tmp_path, "qwen2")
    read = lambda d: ModelConfig.from_dict(json.loads((d / "config.json").read_text())).rope_scaling  # noqa: E731
    assert read(tmp_path / "back") == read(path) is not None
