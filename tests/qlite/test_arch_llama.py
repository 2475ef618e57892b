"""Llama against transformers' LlamaForCausalLM on tiny random checkpoints: no bias (or attention_bias),
Llama 3.1's rope scaling, and GGUF's reordered q/k rows as llama.cpp's converter writes them."""
import pytest

from arch_checks import (assert_gguf_round_trip, assert_greedy_matches, assert_int4_quantizes_generates_and_serves,
                         assert_logits_match)
from qlite.config import ModelConfig
from qlite.errors import QliteError
from tiny_models import make_checkpoint

LLAMA = dict(model_type="llama", intermediate_size=128)
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 32}  # short, so that the tiny context is past it


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("llama") / "ckpt", **LLAMA)


@pytest.mark.parametrize("overrides", [{}, {"tie_word_embeddings": True}, {"attention_bias": True},
                                       {"rope_scaling": LLAMA3_SCALING}, {"head_dim": 32}],
                         ids=["plain", "tied", "bias", "llama3-rope", "head_dim"])
def test_logits_match_transformers(tmp_path, overrides):
    assert_logits_match(make_checkpoint(tmp_path / "ckpt", **{**LLAMA, **overrides}))


def test_greedy_matches_transformers_past_the_original_context(tmp_path):
    assert_greedy_matches(make_checkpoint(tmp_path / "ckpt", **LLAMA, rope_scaling=LLAMA3_SCALING), n=40)


@pytest.mark.parametrize("scaling, needle", [
    ({"rope_type": "longrope", "factor": 4.0}, "does not implement"),
    ({"rope_type": "dynamic", "factor": 4.0}, "needs a positive max_position_embeddings"),  # none to scale from
    ({**LLAMA3_SCALING, "factor": -1.0}, "positive factor"),
    ({**LLAMA3_SCALING, "high_freq_factor": 0.5}, "must exceed"),
])
def test_other_rope_scaling_is_refused_by_name(scaling, needle):
    base = dict(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4)
    with pytest.raises(QliteError, match=needle):
        ModelConfig.from_dict({**base, "rope_scaling": scaling})


def test_int4_quantizes_generates_and_serves(llama, tmp_path, capsys):
    assert_int4_quantizes_generates_and_serves(llama, tmp_path, capsys)


def test_gguf_export_and_import_with_llama_cpp_row_order(llama, tmp_path):
    assert_gguf_round_trip(llama, tmp_path, "llama", permuted_heads=True)
