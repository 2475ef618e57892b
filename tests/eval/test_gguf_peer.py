"""GGUF files as eval peers: llama.cpp's logits on the same tokens, in the same table."""
import sys

import pytest

from eval.gguf_peer import describe_gguf
from eval.run import evaluate
from qlite.cli import main
from qlite.errors import QliteError
from quantize.convert import convert
from tiny_models import make_checkpoint


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny 16-bit model, its int8 quantization and that exported to GGUF (Q8_0: the same weights)."""
    root = tmp_path_factory.mktemp("peer")
    src = make_checkpoint(root / "src", seed=12, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                          num_key_value_heads=2)
    q = convert(src, root / "int8", bits=8, group_size=None, embed_bits=16, progress=False, report=False).out_dir
    assert main(["export", str(q), "--to", "gguf", "--out", str(root / "int8.gguf")]) == 0
    return src, q, root / "int8.gguf"


def test_gguf_row_matches_the_same_weights_in_qlite(pair):
    pytest.importorskip("llama_cpp")  # the bench extra
    src, q, gguf = pair
    rows = evaluate([q, gguf], src, data=["code"], ctx=64, max_chunks=4, dtype="float32", progress=False)
    ours, theirs = (r.metrics for r in rows)
    assert rows[1].format == "llama.cpp Q8_0" and rows[1].bits_per_weight == pytest.approx(8.5)
    assert ours["tokens"] == theirs["tokens"] == 4 * 63
    assert theirs["ppl"] == pytest.approx(ours["ppl"], rel=0.02)  # one model, two engines' arithmetic
    assert theirs["top1"] >= 0.95 and theirs["kld_mean"] < 0.01


def test_a_gguf_is_refused_clearly(pair, tmp_path, monkeypatch, capsys):
    src, _, gguf = pair
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 20)
    with pytest.raises(QliteError, match="not a readable GGUF file"):
        describe_gguf(bad)
    with pytest.raises(QliteError, match="--decode: .* is a GGUF"):
        evaluate([gguf], src, data=["code"], ctx=64, max_chunks=1, decode=True, progress=False)
    assert main(["eval", str(gguf), "--baseline", str(src), "--data", "none", "--tasks", "builtin"]) == 1
    assert "--tasks: " in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as without the bench extra
    with pytest.raises(QliteError, match=r"needs llama-cpp-python \(pip install 'qlite\[bench\]'\)"):
        evaluate([gguf], src, data=["code"], ctx=64, max_chunks=1, progress=False)
