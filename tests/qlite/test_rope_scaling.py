"""Rope scalings (qlite/arch/rope.py) against transformers: the frequencies and attention factor of a
Qwen2.5 long-context config (YaRN) equal transformers' own computation, and tiny Qwen2 / Qwen3 models
with YaRN or linear scaling give transformers' logits, past the original context too."""
import json

import pytest
import torch

from arch_checks import assert_gguf_round_trip, assert_greedy_matches, assert_logits_match
from qlite.config import Qwen2Config
from qlite.model import Rotary
from tiny_models import make_checkpoint

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
    ours = Rotary(Qwen2Config.from_dict({"model_type": "qwen2", **base, "rope_scaling": scaling}))
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


def test_gguf_carries_the_scaling_both_ways(tmp_path):
    """export --to gguf writes llama.cpp's rope scaling keys; import-gguf reads them back into the config."""
    path = make_checkpoint(tmp_path / "ckpt", rope_scaling=dict(YARN))
    assert_gguf_round_trip(path, tmp_path, "qwen2")
    read = lambda d: Qwen2Config.from_dict(json.loads((d / "config.json").read_text())).rope_scaling  # noqa: E731
    assert read(tmp_path / "back") == read(path) is not None
