"""GGUF files as eval peers: llama.cpp's logits on the same tokens, in the same table."""
import sys

import pytest
import torch

from eval.code_eval import answer_tasks, complete_gguf, evaluate_code, task_prompts
from eval.code_tasks import TASKS
from eval.gguf_peer import GgufPeer, describe_gguf
from eval.run import evaluate
from qlite.cli import main
from qlite.errors import QliteError
from qlite.pipeline import load
from quantize.convert import convert
from tiny_models import make_checkpoint


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny 16-bit model, its int8 quantization and that exported to GGUF (Q8_0: the same weights)."""
    root = tmp_path_factory.mktemp("peer")
    src = make_checkpoint(root / "src", seed=12, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=1024)  # room for a code task's prompt
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
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as without the bench extra
    with pytest.raises(QliteError, match=r"needs llama-cpp-python \(pip install 'qlite\[bench\]'\)"):
        evaluate([gguf], src, data=["code"], ctx=64, max_chunks=1, progress=False)


def test_a_gguf_answers_code_tasks_greedily_through_llama_cpp(pair, capsys):
    pytest.importorskip("llama_cpp")
    src, q, gguf = pair
    lm = load(src)
    tasks = TASKS[:3]
    row, sequences = answer_tasks(gguf, tasks, max_new_tokens=12, progress=False, prompter=src)
    assert row.model == "int8.gguf" and [r.name for r in row.results] == [t.name for t in tasks]
    assert [prompt for prompt, _ in sequences] == task_prompts(lm, tasks)  # the baseline's own prompt ids
    peer = GgufPeer(gguf, 1024, lm.tokenizer, lm.model.config.vocab_size)
    for (prompt, answer), result in zip(sequences, row.results):
        assert len(answer) <= 12 and result.tokens == len(answer) and not set(answer) & set(lm.eos_ids)
        assert result.answer == lm.tokenizer.decode(answer)
        logits = peer(torch.tensor([prompt + answer]))[0]  # (T, vocab), one pass
        predicted = logits[len(prompt) - 1:len(prompt) - 1 + len(answer)].argmax(-1).tolist()
        assert predicted == answer  # each token is llama.cpp's own greedy choice after what precedes it

    rows = evaluate_code([q, gguf], src, tasks[:2], max_new_tokens=8, progress=False, fidelity_tasks=2)
    ours, theirs = (r.answer_fidelity for r in rows[1:])
    assert theirs["tokens"] == ours["tokens"] > 0  # both read the baseline's answers
    assert theirs["kld_mean"] < 0.01 and theirs["top1"] >= 0.9  # the same int8 weights in llama.cpp
    assert main(["eval", str(gguf), "--baseline", str(src), "--data", "none", "--tasks", "builtin",
                 "--max-tasks", "2", "--max-new-tokens", "4"]) == 0
    assert "| int8.gguf | 2 |" in capsys.readouterr().out


def test_a_prompt_past_the_context_is_one_clear_line(pair):
    lm = load(pair[0])
    with pytest.raises(QliteError, match=rf"code tasks: {TASKS[0].name}: the prompt's \d+ tokens leave no room in "
                                         r"the model's context of 10$"):
        complete_gguf(None, lm, TASKS[:1], task_prompts(lm, TASKS[:1]), 8, ctx=10)
