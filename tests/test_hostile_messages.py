"""Messages that were poor (issue 54, item 6): each a one-line error naming the flag or the file at fault,
nothing written. (Config fields: tests/qlite/test_config.py; requests: tests/qlite/serve/test_server.py.)"""
import json
import shutil
from pathlib import Path

import pytest

from test_hostile import edit_json, fails_cleanly
from tiny_models import TINY, make_checkpoint


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("messages")
    return {"plain": make_checkpoint(root / "plain", seed=3),
            "hd48": make_checkpoint(root / "hd48", seed=3, **dict(TINY, hidden_size=96, num_attention_heads=2,
                                                                  num_key_value_heads=2))}


@pytest.fixture
def ckpt(sources, tmp_path):
    return Path(shutil.copytree(sources["plain"], tmp_path / "ckpt"))


@pytest.mark.parametrize("kv", ["int8", "int4"])
def test_eval_with_a_quantized_cache_names_a_head_dim_it_does_not_divide(capsys, sources, kv):
    """A raw `RuntimeError: unflatten` before; generate, chat and serve said it already."""
    d = sources["hd48"]
    fails_cleanly(capsys, d, ["eval", d, "--baseline", d, "--kv-cache", kv, "--ctx", "32", "--max-chunks", "1"],
                  f"--kv-cache {kv}", "head_dim 48 is not a multiple of 32")


@pytest.mark.parametrize("scaling, needle", [
    ({"type": "linear", "factor": 1e308}, "factor 1e+308 is outside 1..1024"),  # OverflowError in info, generate
    ({"type": "linear", "factor": 1e-300}, "factor 1e-300 is outside"),  # NaN logits in float32
    ({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "attention_factor": 1e300},
     "attention_factor 1e+300 is outside"),
])
@pytest.mark.parametrize("command", [["info"], ["generate", "-p", "the", "--dtype", "float32", "-m"]])
def test_absurd_rope_numbers_are_refused_when_the_config_is_read(capsys, ckpt, scaling, needle, command):
    edit_json(ckpt / "config.json", rope_scaling=scaling)
    fails_cleanly(capsys, ckpt, [*command, ckpt], "config.json", needle)


@pytest.mark.parametrize("value", [7, ["model.safetensors"], None, {"a": 1}])
def test_a_weight_map_value_that_is_no_file_name(capsys, ckpt, value):
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "model.safetensors", "lm_head.weight": value}}))
    fails_cleanly(capsys, ckpt, ["info", ckpt], "model.safetensors.index.json", "is not a file name")


def test_an_output_whose_parent_is_a_file(capsys, ckpt, tmp_path):
    (tmp_path / "afile").write_text("x")
    fails_cleanly(capsys, tmp_path, ["quantize", ckpt, "--out", tmp_path / "afile" / "q", "--bits", "8"],
                  f"--out {tmp_path / 'afile' / 'q'}: cannot make its directory")


@pytest.mark.parametrize("command", [["quantize", "SRC", "--bits", "8", "--out"],
                                     ["export", "SRC", "--to", "gguf", "--out"]])
def test_an_output_path_holding_a_nul_byte(capsys, ckpt, tmp_path, command):
    """The message named qlite's temporary dir (or click's ValueError)."""
    args = [str(ckpt) if a == "SRC" else a for a in command] + [str(tmp_path / "a\0b")]
    line = fails_cleanly(capsys, tmp_path, args, "'--out'", "a path cannot hold a NUL byte")
    assert ".tmp" not in line


def test_gguf_export_on_a_full_disk_says_so_and_names_the_output(capsys, ckpt, tmp_path, monkeypatch):
    """numpy's short write ('40960 requested and 14816 written') is what a full disk looks like there."""
    from gguf import GGUFWriter

    def short_write(self, *args, **kwargs):
        raise OSError("40960 requested and 14816 written")

    monkeypatch.setattr(GGUFWriter, "write_tensor_data", short_write)
    out = tmp_path / "m.gguf"
    fails_cleanly(capsys, tmp_path, ["export", ckpt, "--to", "gguf", "--out", out],
                  f"--out {out}: cannot be written (no space left on the device")
    assert not list(tmp_path.glob(".m.gguf.tmp-*"))
