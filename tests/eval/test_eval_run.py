"""The eval runner end to end on tiny checkpoints: a model against itself is perfect, a quantized
one is measurably worse, and the reports are written."""
import json

import pytest

from eval.run import evaluate
from qlite.cli import main
from quantize.convert import convert
from tiny_models import make_checkpoint


@pytest.fixture(scope="module")
def base_and_quant(tmp_path_factory):
    root = tmp_path_factory.mktemp("evalrun")
    base = make_checkpoint(root / "base", seed=9, hidden_size=128, intermediate_size=192)
    quant = convert(base, root / "int4", bits=4, group_size=32, progress=False).out_dir
    text = root / "text.txt"
    text.write_text("the thin tin then the theme in the inn " * 40)
    return base, quant, text


def test_self_is_perfect_and_quantized_is_worse(base_and_quant):
    base, quant, text = base_and_quant
    rows = evaluate([base, quant], base, data=[str(text)], ctx=32, max_chunks=3, dtype="float32", progress=False)
    self_row, q_row = rows
    assert self_row.metrics["kld_mean"] == pytest.approx(0, abs=1e-6) and self_row.metrics["top1"] == 1.0
    assert self_row.metrics["tokens"] == 3 * 31
    assert q_row.metrics["kld_mean"] > 1e-4 and q_row.bits_per_weight == pytest.approx(4 + 24 / 32)


def test_models_of_the_same_name_keep_their_own_rows(base_and_quant, tmp_path):
    """Two checkpoints whose dirs share a name (a/q and b/q) each get their own row and numbers: rows are scored by
    name, and they once shared one (the later model's numbers in both rows)."""
    base, quant, text = base_and_quant
    import shutil
    shutil.copytree(base, tmp_path / "a" / "q")  # the baseline itself: KLD 0
    shutil.copytree(quant, tmp_path / "b" / "q")
    rows = evaluate([tmp_path / "a" / "q", tmp_path / "b" / "q"], base, data=[str(text)], ctx=32, max_chunks=2,
                    dtype="float32", progress=False)
    assert [r.model for r in rows] == ["a/q", "b/q"]
    assert rows[0].metrics["kld_mean"] == pytest.approx(0, abs=1e-6) and rows[1].metrics["kld_mean"] > 1e-4


def test_cli_writes_table_and_json(capsys, base_and_quant, tmp_path):
    base, quant, text = base_and_quant
    code = main(["eval", str(quant), "--baseline", str(base), "--data", str(text), "--ctx", "32", "--max-chunks", "2",
                 "--json", str(tmp_path / "r.json"), "--markdown", str(tmp_path / "r.md")])
    out = capsys.readouterr().out
    assert code == 0 and "| int4 | rtn int4-g32, lm_head int8, embeddings int8 |" in out
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert rows[0]["metrics"]["tokens"] == 62
    assert (tmp_path / "r.md").read_text().startswith("| model |")


def test_without_ctx_a_model_with_a_shorter_context_is_scored_at_its_own(capsys, base_and_quant, tmp_path):
    """The default 512 refused a baseline whose context is 256 ('--ctx 512: longer than the model's context')."""
    base, quant, text = base_and_quant
    code = main(["eval", str(quant), "--baseline", str(base), "--data", str(text), "--max-chunks", "1",
                 "--json", str(tmp_path / "r.json")])
    assert code == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["rows"][0]["metrics"]["tokens"] == 255  # one chunk of the context's 256 tokens


def test_mismatched_tokenizer_is_refused(capsys, base_and_quant, tmp_path):
    base, _, text = base_and_quant
    other = make_checkpoint(tmp_path / "other", seed=1, vocab_size=600)
    code = main(["eval", str(other), "--baseline", str(base), "--data", str(text), "--ctx", "32"])
    assert code != 0 and "tokenizer differs from the baseline's" in capsys.readouterr().err


def test_cli_runs_code_tasks_beside_or_without_the_fidelity_table(capsys, tmp_path):
    base = make_checkpoint(tmp_path / "base", seed=9, intermediate_size=192, max_position_embeddings=1024)  # a chat prompt fits
    quant = convert(base, tmp_path / "int4", bits=4, group_size=32, progress=False).out_dir
    code = main(["eval", str(quant), "--baseline", str(base), "--data", "none", "--tasks", "builtin",
                 "--max-tasks", "3", "--max-new-tokens", "8", "--dtype", "float32", "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert code == 0 and "| base | 3 | 0 | 0.0% ± 0.0 | (baseline) |" in out and "| int4 | 3 | 0 |" in out
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["rows"] == [] and [r["model"] for r in report["code_tasks"]] == ["base", "int4"]
    results = report["code_tasks"][1]["results"]
    assert [r["name"] for r in results] == ["reverse_words", "is_palindrome_phrase", "run_length_encode"]
    assert all(not r["passed"] and 1 <= r["tokens"] <= 8 for r in results)  # a random model writes no code
    base_row, int4_row = report["code_tasks"]
    assert base_row["answer_fidelity"] == {}  # int4 read the baseline's answers: its tokens, all of them
    assert int4_row["answer_fidelity"]["tokens"] == base_row["tokens"] and int4_row["answer_fidelity"]["kld_mean"] > 0
    assert main(["eval", str(quant), "--baseline", str(base), "--data", "none"]) != 0
    assert "--data none: nothing to evaluate" in capsys.readouterr().err


def test_decode_scores_the_same_logits_one_token_at_a_time(base_and_quant, capsys, tmp_path):
    """--decode: the KV-cache path gives the one-pass logits (float32, reference kernel), so a model against
    itself stays perfect; the footnote says how the logits were made."""
    base, quant, text = base_and_quant
    kw = dict(data=[str(text)], ctx=32, max_chunks=3, dtype="float32", kernel="reference", progress=False)
    self_row, q_row = evaluate([base, quant], base, decode=True, **kw)
    assert self_row.metrics["kld_mean"] == pytest.approx(0, abs=1e-6) and self_row.metrics["top1"] == 1.0
    assert q_row.metrics["kld_mean"] == pytest.approx(evaluate([quant], base, **kw)[0].metrics["kld_mean"], rel=1e-3)
    code = main(["eval", str(quant), "--baseline", str(base), "--data", str(text), "--ctx", "32", "--max-chunks", "2",
                 "--decode", "--kernel", "reference", "--json", str(tmp_path / "r.json")])
    assert code == 0 and "models run with --kernel reference, one token per step through the KV cache (--decode;" \
        in capsys.readouterr().out
    assert "--decode" in json.loads((tmp_path / "r.json").read_text())["how"]


def test_blocks_through_the_cache_score_what_one_pass_scores(base_and_quant, monkeypatch):
    """Chunks past LONG_CTX go through the KV caches block by block (the baseline's too): the same
    metrics as one pass; a model against itself stays perfect."""
    import eval.run
    from qlite.decoder.causal_lm import CausalLM

    base, quant, text = base_and_quant
    kw = dict(data=[str(text)], ctx=40, max_chunks=2, dtype="float32", kernel="reference", progress=False)
    one_pass = evaluate([base, quant], base, **kw)
    monkeypatch.setattr(eval.run, "LONG_CTX", 16)
    monkeypatch.setattr(CausalLM, "prefill_chunk", 16)  # blocks of 16, 16, 8
    blocks = evaluate([base, quant], base, **kw)
    assert blocks[0].metrics["kld_mean"] == pytest.approx(0, abs=1e-6) and blocks[0].metrics["tokens"] == 2 * 39
    assert blocks[1].metrics["kld_mean"] == pytest.approx(one_pass[1].metrics["kld_mean"], rel=1e-3)
    assert blocks[1].metrics["ppl"] == pytest.approx(one_pass[1].metrics["ppl"], rel=1e-4)


def test_kv_cache_kinds_are_rows_of_their_own(base_and_quant, capsys, tmp_path):
    """--kv-cache bf16 --kv-cache int8 --kv-cache int4: a row per model and kind, read as generation
    reads the cache; the baseline against itself: perfect with bf16, int4 further off than int8."""
    base, quant, text = base_and_quant
    code = main(["eval", str(base), "--baseline", str(base), "--data", str(text), "--ctx", "32", "--max-chunks", "2",
                 "--dtype", "float32", "--kv-cache", "bf16", "--kv-cache", "int8", "--kv-cache", "int4",
                 "--json", str(tmp_path / "r.json")])
    report = json.loads((tmp_path / "r.json").read_text())
    assert code == 0 and "blocks of 512 tokens through the KV cache" in capsys.readouterr().out
    kld = {r["model"]: r["metrics"]["kld_mean"] for r in report["rows"]}
    assert list(kld) == ["base kv bf16", "base kv int8", "base kv int4"]
    assert abs(kld["base kv bf16"]) < 1e-6 < kld["base kv int8"] < kld["base kv int4"]
