"""Convert a GGUF file (qwen2 and the other model types of arch/) into an ordinary checkpoint directory (config, safetensors, tokenizer).

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

from .arch import ARCHITECTURES
from .checkpoint import FLOAT_DTYPES
from .outputs import check_output
from .config import ModelConfig
from .errors import QliteError
from .files import open_regular
from .safetensors_io import TensorSpec, write_checkpoint_dir

TOKEN_CONTROL, TOKEN_USER_DEFINED = 3, 4


def _names(arch) -> tuple:
    return arch.gguf_names if arch is not None else tuple({p: t for a in ARCHITECTURES.values() for p, t in a.gguf_names}.items())


def hf_name(gguf_name: str, arch=None) -> str:
    """A GGUF tensor's name in an HF checkpoint of that architecture (arch None: any's)."""
    for pattern, template in _names(arch):
        m = re.fullmatch(pattern, gguf_name)
        if m:
            return template.format(*m.groups())
    raise QliteError(f"GGUF tensor {gguf_name!r} has no {arch.model_type if arch else 'known'} counterpart")


def gguf_name(name: str, arch=None) -> str:
    """hf_name's inverse: a checkpoint tensor's GGUF name."""
    for pattern, template in _names(arch):
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


def gguf_architecture(reader):
    name = _field(reader, "general.architecture")
    arch = next((a for a in ARCHITECTURES.values() if a.gguf_arch == name), None)
    if arch is None:
        known = ", ".join(repr(a.gguf_arch) for a in ARCHITECTURES.values())
        raise QliteError(f"architecture is {name!r}, qlite imports {known}")
    return arch


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def read_config(reader) -> dict:
    arch = gguf_architecture(reader)
    p = arch.gguf_arch  # the metadata keys' prefix
    try:
        n_head = int(_field(reader, f"{p}.attention.head_count"))
        hidden = int(_field(reader, f"{p}.embedding_length"))
        cfg = {
            "architectures": [arch.hf_class],
            "model_type": arch.model_type,
            "vocab_size": len(reader.fields["tokenizer.ggml.tokens"].data),
            "hidden_size": hidden,
            "intermediate_size": int(_field(reader, f"{p}.feed_forward_length")),
            "num_hidden_layers": int(_field(reader, f"{p}.block_count")),
            "num_attention_heads": n_head,
            "num_key_value_heads": int(_field(reader, f"{p}.attention.head_count_kv", n_head)),
            "max_position_embeddings": int(_field(reader, f"{p}.context_length")),
            "rope_theta": float(_field(reader, f"{p}.rope.freq_base", arch.rope_theta)),
            "rms_norm_eps": float(np.float32(_field(reader, f"{p}.attention.layer_norm_rms_epsilon"))),
            "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors),
            "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id", arch.gguf_bos)),
            "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id")),
            "hidden_act": "silu",
        }
        head_dim = _field(reader, f"{p}.attention.key_length")
        if head_dim is not None and int(head_dim) * n_head != hidden:
            cfg["head_dim"] = int(head_dim)
        if arch.qkv_bias is None:
            cfg["attention_bias"] = any(t.name.endswith("attn_q.bias") for t in reader.tensors)
        cfg.update(arch.gguf_config(lambda key: _field(reader, f"{p}.{key}")))
        if "qkv_bias" in arch.config_fields:  # Qwen2-MoE: q/k/v bias as the tensors say
            cfg["qkv_bias"] = any(t.name.endswith("attn_q.bias") for t in reader.tensors)
        kind = _field(reader, f"{p}.rope.scaling.type")
        if kind not in (None, "none"):  # llama.cpp's rope scaling keys, as its converter writes them
            cfg["rope_scaling"] = {"rope_type": kind, "factor": float(_field(reader, f"{p}.rope.scaling.factor"))}
            original = _field(reader, f"{p}.rope.scaling.original_context_length")
            if original is not None:
                cfg["rope_scaling"]["original_max_position_embeddings"] = int(original)
        if any(t.name == "rope_freqs.weight" for t in reader.tensors):
            raise QliteError("the GGUF holds rope_freqs (scaled rotary frequencies, as llama.cpp writes Llama 3.1's): "
                             "not imported yet")
    except (KeyError, TypeError) as e:
        raise QliteError(f"GGUF metadata incomplete ({e})") from None
    cfg["rms_norm_eps"] = float(f"{cfg['rms_norm_eps']:.6g}")  # stored as float32: 1e-6, not 9.99e-7
    blocks = {int(m[1]) for m in (re.match(r"blk\.(\d+)\.", t.name) for t in reader.tensors) if m}
    if len(blocks) != cfg["num_hidden_layers"] or blocks and max(blocks) != len(blocks) - 1:  # 0..n-1
        raise QliteError(f"{p}.block_count is {cfg['num_hidden_layers']}, the tensors hold {len(blocks)} blocks")
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
        pre_tokenizers.Split(Regex(gguf_architecture(reader).gguf_split), behavior="isolated"),
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
        "tokenizer_class": gguf_architecture(reader).tokenizer_class,
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


def unstacked(name: str, shape: tuple) -> list[tuple[str, tuple]]:
    """A tensor's (name, shape) in the checkpoint: a 3-D stack of experts (model.layers.3.mlp.experts.up_proj.weight,
    (experts, rows, columns)) as each expert's own, any other as it is."""
    if len(shape) != 3:
        return [(name, shape)]
    stack, _, proj = name.removesuffix(".weight").rpartition(".")
    if not stack.endswith(".mlp.experts"):
        raise QliteError(f"tensor {name!r} is 3-D {shape}: only a layer's experts are stacked")
    return [(f"{stack}.{e}.{proj}.weight", shape[1:]) for e in range(shape[0])]


def import_gguf(gguf_path: str | Path, out_dir: str | Path, dtype: str = "float16", force: bool = False,
                progress: bool = True, out_flag: str = "--out") -> Path:
    """Write a checkpoint dir for a GGUF file of a model type qlite runs. Tensors are stored in `dtype` (float16 default).
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
        arch = gguf_architecture(reader)
        specs = [TensorSpec(name, torch_dtype, shape) for t in reader.tensors
                 for name, shape in unstacked(hf_name(t.name, arch), tuple(int(d) for d in reversed(t.shape)))]
    except QliteError as e:
        raise QliteError(f"{gguf_path}: {e}") from None
    except (UnicodeDecodeError, KeyError, IndexError, TypeError, ValueError, OverflowError) as e:
        raise QliteError(f"{gguf_path}: malformed GGUF metadata ({type(e).__name__}: {e})") from None
    config["torch_dtype"] = dtype
    cfg = ModelConfig.from_dict(config, source=f"{gguf_path}: its metadata as config.json")  # never write what qlite refuses
    embed = next((s.shape for s in specs if s.name == "model.embed_tokens.weight"), None)
    if embed is not None and embed != (cfg.vocab_size, cfg.hidden_size):
        raise QliteError(f"{gguf_path}: tokenizer.ggml.tokens lists {cfg.vocab_size} tokens and embedding_length is "
                         f"{cfg.hidden_size}, but token_embd.weight is {embed[0]} x {embed[1]}")

    def tensors():
        from tqdm import tqdm
        for t in tqdm(reader.tensors, desc="import", unit="tensor", disable=not progress, leave=False):
            name = hf_name(t.name, arch)
            tensor = torch.from_numpy(_dequantized(t)).to(torch_dtype)
            if tensor.ndim == 3:  # a layer's experts, one after another
                yield from ((part, tensor[e]) for e, (part, _) in enumerate(unstacked(name, tensor.shape)))
                continue
            order = arch.gguf_rows(name, tensor.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads)
            yield name, tensor if order is None else tensor[torch.argsort(order)]

    files = {"tokenizer.json": tokenizer.to_str(pretty=True),
             "tokenizer_config.json": json.dumps(tok_config, indent=2, ensure_ascii=False),
             "generation_config.json": json.dumps(gen_config, indent=2)}
    write_checkpoint_dir(out_dir, specs, tensors(), config, inputs=(gguf_path,), force=force, flag=out_flag, files=files)
    return out_dir
