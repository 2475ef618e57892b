"""The quantization report: recipe and sizes from the written files, fidelity equal to `qlite eval`
on the same chunks (the eval runs both whole models; the report streams the source layer by layer)."""
import json

import pytest

from eval.run import evaluate
from qlite.checkpoint import CheckpointDir
from qlite.cli import main
from qlite.info import REPORT_NAME
from qlite.tokenizer import Tokenizer
from qlite.texts import load_text
from quantize.convert import convert
from quantize.report import CHUNKS, leading_tokens
from tiny_models import make_checkpoint

DIMS = dict(hidden_size=128, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("rsrc") / "ckpt", seed=9, **DIMS)


def test_report_matches_qlite_eval_on_the_same_chunks(src, tmp_path):
    summary = convert(src, tmp_path / "q", bits=4, group_size=32, progress=False)
    report = json.loads((summary.out_dir / REPORT_NAME).read_text())
    ckpt = CheckpointDir(summary.out_dir)
    assert report["bytes"] == sum(t.nbytes for t in ckpt.tensors.values()) == summary.bytes_after
    assert report["bits_per_parameter"] == pytest.approx(summary.bits_per_parameter, abs=1e-4)
    recipe = report["recipe"]
    assert recipe["model.layers.1.mlp.down_proj"] == "int4-g32" and recipe["lm_head"] == "int8"
    assert recipe["model.embed_tokens"] == "int8" and len(recipe) == 2 * 7 + 2
    ctx = report["fidelity"]["ctx"]
    rows = evaluate([summary.out_dir], src, ctx=ctx, max_chunks=CHUNKS, progress=False)
    for row in rows:
        ours = report["fidelity"]["texts"][row.data]
        assert ours["tokens"] == row.metrics["tokens"] == CHUNKS * (ctx - 1)
        assert ours["top1"] == row.metrics["top1"]
        for key in ("kld_mean", "ppl_ratio", "kld_p99"):
            assert ours[key] == pytest.approx(row.metrics[key], rel=1e-3), (row.data, key)
    assert summary.fidelity == report["fidelity"] and "fidelity against the source" in str(summary)


def test_no_report_measures_nothing_and_info_says_so(src, tmp_path, capsys):
    assert main(["quantize", str(src), "--out", str(tmp_path / "q"), "--group-size", "32", "--no-report"]) == 0
    assert "fidelity not measured (--no-report)" in capsys.readouterr().out
    assert json.loads((tmp_path / "q" / REPORT_NAME).read_text())["fidelity"] is None
    assert main(["info", str(tmp_path / "q")]) == 0
    out = capsys.readouterr().out
    assert "recipe         int4-g32 x 14, int8 x 2" in out and "fidelity       not measured (--no-report)" in out


def test_info_prints_the_fidelity_and_survives_a_broken_report(src, tmp_path, capsys):
    assert main(["quantize", str(src), "--out", str(tmp_path / "q"), "--bits", "8"]) == 0
    capsys.readouterr()
    assert main(["info", str(tmp_path / "q")]) == 0
    out = capsys.readouterr().out
    assert "code text      KLD 0.0" in out and "measured at quantize time" in out and "prose text" in out
    (tmp_path / "q" / REPORT_NAME).write_text('{"recipe": 5}')
    assert main(["info", str(tmp_path / "q")]) == 0
    assert f"{REPORT_NAME}: unreadable (not a qlite quantization report)" in capsys.readouterr().out
    (tmp_path / "q" / REPORT_NAME).write_text("{not json")
    assert main(["info", str(tmp_path / "q")]) == 0 and f"{REPORT_NAME}: not valid JSON" in capsys.readouterr().out


def test_tied_shared_table_is_named_in_the_recipe(tmp_path):
    tied = make_checkpoint(tmp_path / "tied", seed=4, tie_word_embeddings=True, **DIMS)
    summary = convert(tied, tmp_path / "q", bits=4, group_size=32, progress=False)
    report = json.loads((summary.out_dir / REPORT_NAME).read_text())
    assert report["recipe"]["lm_head"] == "int8 (the embedding table)"
    assert report["fidelity"]["texts"]["code"]["kld_mean"] > 0


def test_leading_tokens_equal_the_whole_texts_first_tokens(src):
    tokenizer = Tokenizer(src)
    for text in ("code", "prose"):
        whole = tokenizer.encode(load_text(text))
        assert leading_tokens(tokenizer, load_text(text), 1000) == whole[:1000]
    assert leading_tokens(tokenizer, "a b c", 1000) == tokenizer.encode("a b c")  # shorter than asked


def test_a_tokenizer_the_report_cannot_read_is_named_before_any_work(src, tmp_path, capsys):
    import shutil
    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    (broken / "tokenizer_config.json").write_bytes(b"\xff{")
    assert main(["quantize", str(broken), "--out", str(tmp_path / "q"), "--group-size", "32"]) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [f"error: {broken / 'tokenizer_config.json'}: not UTF-8 text (byte 0)"]
    assert not (tmp_path / "q").exists()
    assert main(["quantize", str(broken), "--out", str(tmp_path / "q"), "--group-size", "32", "--no-report"]) == 0


def test_a_source_without_tokenizer_gets_a_report_without_fidelity(src, tmp_path):
    import shutil
    bare = tmp_path / "bare"
    shutil.copytree(src, bare)
    (bare / "tokenizer.json").unlink()
    summary = convert(bare, tmp_path / "q", bits=4, group_size=32, progress=False)
    report = json.loads((summary.out_dir / REPORT_NAME).read_text())
    assert report["fidelity"] is None and report["not_measured"] == "SRC has no tokenizer.json"
    assert "fidelity not measured (SRC has no tokenizer.json)" in str(summary)
