"""Metrics on cases computable by hand."""
import math

import numpy as np
import pytest
import torch

from qlite.texts import load_text
from qlite.fidelity import Fidelity, chunk_tokens, token_stats
from qlite.errors import QliteError


def summarize(base_logits, model_logits, targets):
    f = Fidelity()
    f.add(token_stats(torch.log_softmax(base_logits, -1), model_logits, torch.tensor(targets)))
    return f.summary()


def test_a_model_against_itself():
    logits = torch.randn(50, 11, generator=torch.Generator().manual_seed(0))
    s = summarize(logits, logits, list(range(10)) * 5)
    assert s["kld_mean"] == pytest.approx(0, abs=1e-6) and s["kld_p99.9"] == pytest.approx(0, abs=1e-6)
    assert s["ppl_ratio"] == pytest.approx(1.0) and s["ppl_ratio_err"] == pytest.approx(0, abs=1e-9)
    assert s["top1"] == 1.0 and s["dp_mean"] == 0 and s["dp_rms"] == 0
    assert s["ppl"] == pytest.approx(s["base_ppl"])


def test_known_kld_and_perplexity():
    base = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5]]))
    model = torch.log(torch.tensor([[0.9, 0.1], [0.9, 0.1]]))
    s = summarize(base, model, [0, 1])
    kl = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert s["kld_mean"] == pytest.approx(kl, rel=1e-5)
    assert s["base_ppl"] == pytest.approx(2.0)  # uniform over two tokens
    assert s["ppl"] == pytest.approx(math.exp(-(math.log(0.9) + math.log(0.1)) / 2), rel=1e-5)
    assert s["dp_mean"] == pytest.approx(((0.9 - 0.5) + (0.1 - 0.5)) / 2, abs=1e-6)
    assert s["dp_rms"] == pytest.approx(0.4, rel=1e-5)
    assert s["top1"] == 1.0  # ties in the baseline break to index 0, as the model's argmax


def test_uniform_model_has_vocabulary_perplexity_and_top1_counts_disagreements():
    V = 1000
    uniform = torch.zeros(4, V)
    peaked = torch.zeros(4, V)
    peaked[torch.arange(4), torch.tensor([3, 0, 5, 0])] = 10.0
    s = summarize(peaked, uniform, [1, 2, 3, 4])
    assert s["ppl"] == pytest.approx(V, rel=1e-5)
    assert s["top1"] == 0.5  # uniform argmax is token 0: agrees on rows 1 and 3
    assert np.isfinite(s["ppl_ratio_err"])


def test_chunking_and_sources():
    assert chunk_tokens(list(range(10)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert chunk_tokens(list(range(10)), 3, max_chunks=2) == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(QliteError, match="fewer than one --ctx 20 chunk"):
        chunk_tokens(list(range(10)), 20)
    assert "def dedent" in load_text("code")
    with pytest.raises(QliteError, match="--data nonexistent.txt"):
        load_text("nonexistent.txt")
