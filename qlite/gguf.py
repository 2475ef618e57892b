"""Convert a qwen2 GGUF file into an ordinary checkpoint directory (config, safetensors, tokenizer).

Tensors are dequantized one at a time with ggml's own reader (`gguf.quants.dequantize`) and streamed
into safetensors. The tokenizer is rebuilt with `tokenizers` from the GGUF vocabulary and merges:
byte-level BPE with Qwen2's split regex, control tokens as special tokens.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch

from .checkpoint import FLOAT_DTYPES
from .outputs import atomic_output_dir, check_output
from .config import Qwen2Config
from .errors import QliteError
from .files import open_regular
from .safetensors_io import TensorSpec, write_sharded

# Qwen2's pre-tokenizer split (digits one at a time), the one its merges were learned with.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
TOKEN_CONTROL, TOKEN_USER_DEFINED = 3, 4

GGUF_TO_HF = [  # (GGUF name pattern, HF name template)
    (r"token_embd\.weight", "model.embed_tokens.weight"),
    (r"output_norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (r"blk\.(\d+)\.attn_norm\.weight", "model.layers.{}.input_layernorm.weight"),
    (r"blk\.(\d+)\.ffn_norm\.weight", "model.layers.{}.post_attention_layernorm.weight"),
    (r"blk\.(\d+)\.attn_q\.(weight|bias)", "model.layers.{}.self_attn.q_proj.{}"),
    (r"blk\.(\d+)\.attn_k\.(weight|bias)", "model.layers.{}.self_attn.k_proj.{}"),
    (r"blk\.(\d+)\.attn_v\.(weight|bias)", "model.layers.{}.self_attn.v_proj.{}"),
    (r"blk\.(\d+)\.attn_output\.weight", "model.layers.{}.self_attn.o_proj.weight"),
    (r"blk\.(\d+)\.ffn_gate\.weight", "model.layers.{}.mlp.gate_proj.weight"),
    (r"blk\.(\d+)\.ffn_up\.weight", "model.layers.{}.mlp.up_proj.weight"),
    (r"blk\.(\d+)\.ffn_down\.weight", "model.layers.{}.mlp.down_proj.weight"),
]


def hf_name(gguf_name: str) -> str:
    for pattern, template in GGUF_TO_HF:
        m = re.fullmatch(pattern, gguf_name)
        if m:
            return template.format(*m.groups())
    raise QliteError(f"GGUF tensor {gguf_name!r} has no qwen2 counterpart")


def gguf_name(name: str) -> str:
    """hf_name's inverse: a Qwen2 checkpoint tensor's GGUF name."""
    for pattern, template in GGUF_TO_HF:
        parts = template.split("{}")
        groups = [r"(\d+)", r"(weight|bias)"]
        hf_pattern = "".join(re.escape(p) + (groups[i] if i < len(parts) - 1 else "") for i, p in enumerate(parts))
        m = re.fullmatch(hf_pattern, name)
        if m:
            out = pattern
            for g in m.groups():
                out = re.sub(r"\([^)]*\)", g, out, count=1)
            return out.replace("\\.", ".")
    raise QliteError(f"tensor {name!r} has no GGUF counterpart")


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def read_config(reader) -> dict:
    arch = _field(reader, "general.architecture")
    if arch != "qwen2":
        raise QliteError(f"architecture is {arch!r}, qlite imports only 'qwen2'")
    try:
        n_head = int(_field(reader, "qwen2.attention.head_count"))
        cfg = {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "vocab_size": len(reader.fields["tokenizer.ggml.tokens"].data),
            "hidden_size": int(_field(reader, "qwen2.embedding_length")),
            "intermediate_size": int(_field(reader, "qwen2.feed_forward_length")),
            "num_hidden_layers": int(_field(reader, "qwen2.block_count")),
            "num_attention_heads": n_head,
            "num_key_value_heads": int(_field(reader, "qwen2.attention.head_count_kv", n_head)),
            "max_position_embeddings": int(_field(reader, "qwen2.context_length")),
            "rope_theta": float(_field(reader, "qwen2.rope.freq_base", 1_000_000.0)),
            "rms_norm_eps": float(np.float32(_field(reader, "qwen2.attention.layer_norm_rms_epsilon"))),
            "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors),
            "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id", 151643)),
            "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id")),
            "hidden_act": "silu",
        }
    except (KeyError, TypeError) as e:
        raise QliteError(f"GGUF metadata incomplete ({e})") from None
    cfg["rms_norm_eps"] = float(f"{cfg['rms_norm_eps']:.6g}")  # stored as float32: 1e-6, not 9.99e-7
    blocks = {int(m[1]) for m in (re.match(r"blk\.(\d+)\.", t.name) for t in reader.tensors) if m}
    if len(blocks) != cfg["num_hidden_layers"] or blocks and max(blocks) != len(blocks) - 1:  # 0..n-1
        raise QliteError(f"qwen2.block_count is {cfg['num_hidden_layers']}, the tensors hold {len(blocks)} blocks")
    return cfg


def build_tokenizer(reader):
    """A `tokenizers.Tokenizer` from the GGUF vocabulary (byte-level BPE, as gpt2/qwen2 in llama.cpp)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    if _field(reader, "tokenizer.ggml.model") != "gpt2":
        raise QliteError("GGUF tokenizer is not byte-level BPE (tokenizer.ggml.model != 'gpt2')")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, ty in zip(tokens, types) if ty == TOKEN_CONTROL])
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, ty in zip(tokens, types) if ty == TOKEN_USER_DEFINED])
    return tok


def read_metadata(reader) -> tuple[dict, object, dict, dict]:
    """config.json, the tokenizer, tokenizer_config.json and generation_config.json from the metadata."""
    config = read_config(reader)
    tokenizer = build_tokenizer(reader)
    eos = config["eos_token_id"]
    pad = int(_field(reader, "tokenizer.ggml.padding_token_id", config["bos_token_id"]))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    tok_config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "eos_token": tokens[eos], "pad_token": tokens[pad], "bos_token": None,
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "model_max_length": config["max_position_embeddings"],
    }
    template = _field(reader, "tokenizer.chat_template")
    if template:
        tok_config["chat_template"] = template
    gen_config = {"bos_token_id": config["bos_token_id"], "pad_token_id": pad, "eos_token_id": sorted({eos, pad})}
    return config, tokenizer, tok_config, gen_config


def _dequantized(t) -> np.ndarray:
    from gguf.quants import dequantize
    # GGUF lists the fastest axis first, so numpy's shape is already (out_features, in_features).
    shape = tuple(int(d) for d in reversed(t.shape))
    return np.require(dequantize(t.data, t.tensor_type).reshape(shape), requirements="W")  # F32 comes back read-only


def import_gguf(gguf_path: str | Path, out_dir: str | Path, dtype: str = "float16", force: bool = False,
                progress: bool = True, out_flag: str = "--out") -> Path:
    """Write a checkpoint dir for a qwen2 GGUF file. Tensors are stored in `dtype` (float16 default).
    out_flag: how errors name out_dir (the command's flag or argument)."""
    from gguf import GGUFReader

    gguf_path, out_dir = Path(gguf_path).expanduser(), Path(out_dir).expanduser()
    check_output(out_dir, force, (gguf_path,), out_flag)  # before the long part; checked again at the end
    torch_dtype = FLOAT_DTYPES.get(dtype)
    if torch_dtype is None:
        raise QliteError(f"--dtype {dtype}: choose float16, bfloat16 or float32")
    open_regular(gguf_path).close()  # a FIFO or device is an error here, not a hang in the reader
    try:
        reader = GGUFReader(gguf_path)
    except FileNotFoundError:
        raise QliteError(f"{gguf_path}: not found") from None
    except Exception as e:  # the reader raises ValueError, struct errors, ... on a bad file
        raise QliteError(f"{gguf_path}: not a readable GGUF file ({e})") from None
    try:
        config, tokenizer, tok_config, gen_config = read_metadata(reader)
        specs = [TensorSpec(hf_name(t.name), torch_dtype, tuple(int(d) for d in reversed(t.shape)))
                 for t in reader.tensors]
    except QliteError as e:
        raise QliteError(f"{gguf_path}: {e}") from None
    except (UnicodeDecodeError, KeyError, IndexError, TypeError, ValueError, OverflowError) as e:
        raise QliteError(f"{gguf_path}: malformed GGUF metadata ({type(e).__name__}: {e})") from None
    config["torch_dtype"] = dtype
    cfg = Qwen2Config.from_dict(config, source=f"{gguf_path}: its metadata as config.json")  # never write what qlite refuses
    embed = next((s.shape for s in specs if s.name == "model.embed_tokens.weight"), None)
    if embed is not None and embed != (cfg.vocab_size, cfg.hidden_size):
        raise QliteError(f"{gguf_path}: tokenizer.ggml.tokens lists {cfg.vocab_size} tokens and embedding_length is "
                         f"{cfg.hidden_size}, but token_embd.weight is {embed[0]} x {embed[1]}")

    def tensors():
        from tqdm import tqdm
        for t in tqdm(reader.tensors, desc="import", unit="tensor", disable=not progress, leave=False):
            yield hf_name(t.name), torch.from_numpy(_dequantized(t)).to(torch_dtype)

    with atomic_output_dir(out_dir, force=force, inputs=(gguf_path,), flag=out_flag) as tmp:
        write_sharded(tmp, specs, tensors(), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        tokenizer.save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, ensure_ascii=False))
        (tmp / "generation_config.json").write_text(json.dumps(gen_config, indent=2))
    return out_dir
