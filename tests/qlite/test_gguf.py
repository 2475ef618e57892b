"""import-gguf on a tiny qwen2 GGUF written with gguf's own writer, checked against transformers
loading the same file."""
import numpy as np
import pytest
import torch

from qlite.loader import load_model
from qlite.gguf import import_gguf
from qlite.tokenizer import Tokenizer

H, I, LAYERS, HEADS, KV = 64, 96, 2, 4, 2


def tiny_vocab():
    from tokenizers import pre_tokenizers
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = ["Ġ t", "h e", "Ġt he", "i n"]
    tokens += [m.replace(" ", "") for m in merges]
    types = [1] * len(tokens)
    tokens += ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>"]
    types += [3, 3, 3, 4]
    return tokens, types, merges


def write_tiny_gguf(path, arch="qwen2"):
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    rng = np.random.default_rng(0)
    tokens, types, merges = tiny_vocab()
    V, D = len(tokens), H // HEADS
    w = GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(128)
    w.add_embedding_length(H)
    w.add_feed_forward_length(I)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_pad_token_id(tokens.index("<|endoftext|>"))
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}<|im_start|>assistant\n")
    source = {}

    def add(name, shape, q8=False, scale=0.1):
        arr = (rng.standard_normal(shape) * scale).astype(np.float32)
        if q8:  # stored as Q8_0, as many GGUF tensors are; the importer must dequantize it
            w.add_tensor(name, quantize(arr, GGMLQuantizationType.Q8_0),
                         raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, arr)
        source[name] = arr

    add("token_embd.weight", (V, H), q8=True)
    for b in range(LAYERS):
        add(f"blk.{b}.attn_norm.weight", (H,), scale=1.0)
        add(f"blk.{b}.attn_q.weight", (H, H), q8=True)
        add(f"blk.{b}.attn_q.bias", (H,))
        add(f"blk.{b}.attn_k.weight", (KV * D, H))
        add(f"blk.{b}.attn_k.bias", (KV * D,))
        add(f"blk.{b}.attn_v.weight", (KV * D, H), q8=True)
        add(f"blk.{b}.attn_v.bias", (KV * D,))
        add(f"blk.{b}.attn_output.weight", (H, H))
        add(f"blk.{b}.ffn_norm.weight", (H,), scale=1.0)
        add(f"blk.{b}.ffn_gate.weight", (I, H), q8=True)
        add(f"blk.{b}.ffn_up.weight", (I, H))
        add(f"blk.{b}.ffn_down.weight", (H, I), q8=True)
    add("output_norm.weight", (H,), scale=1.0)
    add("output.weight", (V, H))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return source


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
