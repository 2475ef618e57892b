"""Tiny random Qwen2 checkpoints written by transformers (the test-only reference)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.08)
CONFIGS = {
    "gqa7": dict(TINY, hidden_size=112, num_attention_heads=14, num_key_value_heads=2),  # 7:1, as in the 0.5B
    "mha": dict(TINY, num_attention_heads=4, num_key_value_heads=4),
    "tied": dict(TINY, tie_word_embeddings=True),
}
# widths the native kernels take (head_dim 64, every input width a multiple of 128)
NATIVE_WIDTHS = dict(TINY, hidden_size=256, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2)

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def write_tiny_tokenizer(path: Path, vocab_size: int) -> None:
    """A byte-level BPE over the 256 byte symbols plus a few merges and the ChatML special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    assert tok.get_vocab_size() <= vocab_size
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
        "chat_template": CHAT_TEMPLATE}))


def make_checkpoint(path: Path, seed: int = 0, max_shard_size: str | None = None, **overrides) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    params = dict(TINY, **overrides)
    cfg = Qwen2Config(**params, bos_token_id=259, eos_token_id=263, pad_token_id=261)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # random init is tiny for biases and norms; make every parameter count
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    eos_id = 263
    write_tiny_tokenizer(path, cfg.vocab_size)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos_id]}))
    return path



def hf_model(path: Path):
    from transformers import Qwen2ForCausalLM
    return Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


PRIME_PROMPT = "Write a Python function that checks whether a number is prime."


def check_prime_code(completion: str) -> None:
    """Extract the first Python code block of a completion, run it in a fresh interpreter, and
    assert its function answers 1, 2, 15, 17, 97 correctly."""
    import re
    import subprocess
    import sys

    blocks = re.findall(r"```(?:python)?\n(.*?)```", completion, re.S)
    assert blocks, f"no code block in:\n{completion}"
    name = re.search(r"def (\w+)\(", blocks[0])
    assert name, f"no function in:\n{blocks[0]}"
    probe = blocks[0] + f"\nprint([bool({name.group(1)}(n)) for n in (1, 2, 15, 17, 97)])\n"
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=30)
    assert r.stdout.strip() == "[False, True, False, True, True]", f"{r.stdout}{r.stderr}\n{completion}"
