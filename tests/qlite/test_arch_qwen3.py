"""Qwen3 (dense) against transformers' Qwen3ForCausalLM on tiny random checkpoints: per-head q/k norms,
no q/k/v bias, a head_dim that is not hidden_size / heads."""
import pytest

from arch_checks import (assert_gguf_round_trip, assert_greedy_matches, assert_int4_quantizes_generates_and_serves,
                         assert_logits_match)
from tiny_models import make_checkpoint

QWEN3 = dict(model_type="qwen3", head_dim=32, intermediate_size=128)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("qwen3") / "ckpt", **QWEN3)


@pytest.mark.parametrize("overrides", [{}, {"tie_word_embeddings": True}, {"head_dim": 16, "attention_bias": True}],
                         ids=["untied", "tied", "head_dim-of-hidden-with-bias"])
def test_logits_match_transformers(tmp_path, overrides):
    assert_logits_match(make_checkpoint(tmp_path / "ckpt", **{**QWEN3, **overrides}))


def test_greedy_matches_transformers(qwen3):
    assert_greedy_matches(qwen3)


def test_int4_quantizes_generates_and_serves(qwen3, tmp_path, capsys):
    assert_int4_quantizes_generates_and_serves(qwen3, tmp_path, capsys)


def test_gguf_export_and_import(qwen3, tmp_path):
    assert_gguf_round_trip(qwen3, tmp_path, "qwen3")
