"""Tiny random checkpoints written by transformers (the test-only reference): Qwen2 by default, any
model type qlite runs with model_type=."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
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
# mixtures of experts at those widths: Qwen2-MoE with its shared expert and a dense layer among sparse ones
# (model_type= passed with them to make_checkpoint), Qwen3-MoE with renormalized top-k weights
MOE = {
    "qwen2_moe": dict(NATIVE_WIDTHS, num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
                      shared_expert_intermediate_size=256, mlp_only_layers=[1]),
    "qwen3_moe": dict(NATIVE_WIDTHS, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=128, norm_topk_prob=True,
                      head_dim=64),
}

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
    tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in ("<tool_call>", "</tool_call>")])  # Qwen2's markup
    assert tok.get_vocab_size() <= vocab_size
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
        "chat_template": CHAT_TEMPLATE}))


def make_checkpoint(path: Path, seed: int = 0, max_shard_size: str | None = None, model_type: str = "qwen2",
                    **overrides) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    params = dict(TINY, **overrides)
    cfg = AutoConfig.for_model(model_type, **params, bos_token_id=259, eos_token_id=263, pad_token_id=261)
    model = AutoModelForCausalLM.from_config(cfg).eval()
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
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


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


H, I, LAYERS, HEADS, GGUF_KV = 64, 96, 2, 4, 2  # the tiny GGUF's sizes


def tiny_vocab():
    from tokenizers import pre_tokenizers
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = ["Ġ t", "h e", "Ġt he", "i n"]
    tokens += [m.replace(" ", "") for m in merges]
    types = [1] * len(tokens)
    tokens += ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>"]
    types += [3, 3, 3, 4]
    return tokens, types, merges


def write_tiny_gguf(path, arch="qwen2", head_count=HEADS, rms_eps=1e-6):
    """A tiny qwen2 GGUF written with gguf's own writer (some tensors Q8_0); returns the float source tensors.
    head_count, rms_eps: the metadata only (a hostile file's lies), the tensors keep HEADS' shapes."""
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
    w.add_head_count(head_count)
    w.add_head_count_kv(GGUF_KV)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(rms_eps)
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
        add(f"blk.{b}.attn_k.weight", (GGUF_KV * D, H))
        add(f"blk.{b}.attn_k.bias", (GGUF_KV * D,))
        add(f"blk.{b}.attn_v.weight", (GGUF_KV * D, H), q8=True)
        add(f"blk.{b}.attn_v.bias", (GGUF_KV * D,))
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
