"""import-gguf on a tiny qwen2 GGUF written with gguf's own writer, checked against transformers
loading the same file."""
import pytest
import torch

from qlite.loader import load_model
from qlite.gguf import import_gguf
from qlite.tokenizer import Tokenizer
from tiny_models import GGUF_KV as KV, tiny_vocab, write_tiny_gguf

@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path)
    return path


def test_imported_model_matches_transformers_on_the_same_gguf(tiny_gguf, tmp_path):
    from transformers import AutoModelForCausalLM

    out = import_gguf(tiny_gguf, tmp_path / "ckpt", dtype="float32", progress=False)
    ours = load_model(out, dtype="float32")
    ref = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name,
                                               dtype=torch.float32).eval()
    ids = torch.randint(0, ours.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (ours(ids) - ref(ids).logits).abs().max().item()
    assert diff <= 1e-4
    assert not ours.config.tie_word_embeddings and ours.config.num_key_value_heads == KV


def test_imported_tokenizer_and_template(tiny_gguf, tmp_path):
    out = import_gguf(tiny_gguf, tmp_path / "ckpt", progress=False)
    tok = Tokenizer(out)
    tokens, _, _ = tiny_vocab()
    text = "<|im_start|>user\nthe thin <think> 日本 🙂<|im_end|>"
    ids = tok.encode(text)
    assert ids[0] == tokens.index("<|im_start|>") and tokens.index("<think>") in ids
    assert tok.decode(ids) == text
    assert tok.eos_token == "<|im_end|>" and tok.chat_template.startswith("{% for m in messages %}")
    f16 = load_model(out, dtype="float32")
    assert f16.model.layers[0].self_attn.qkv_proj.bias.dtype == torch.float32  # fused at load


def test_import_refuses_existing_output_unless_forced(tiny_gguf, tmp_path):
    from qlite.errors import QliteError
    out = import_gguf(tiny_gguf, tmp_path / "ckpt", progress=False)
    with pytest.raises(QliteError, match="already exists"):
        import_gguf(tiny_gguf, out, progress=False)
    import_gguf(tiny_gguf, out, force=True, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary dirs left


def test_import_never_replaces_the_dir_that_holds_the_gguf(tiny_gguf, tmp_path):
    import shutil
    from qlite.errors import QliteError
    home = tmp_path / "models"
    home.mkdir()
    (home / "config.json").write_text("{}")  # even a dir that looks like a checkpoint
    gguf = home / "model.gguf"
    shutil.copy(tiny_gguf, gguf)
    before = gguf.read_bytes()
    with pytest.raises(QliteError, match="holds the input"):
        import_gguf(gguf, home, force=True, progress=False)
    assert gguf.read_bytes() == before and sorted(p.name for p in home.iterdir()) == ["config.json", "model.gguf"]
