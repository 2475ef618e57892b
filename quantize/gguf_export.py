"""A qlite checkpoint as a GGUF file for llama.cpp, written with ggml's own `gguf` writer and streamed
tensor by tensor: quantized linears as Q8_0 / Q4_0 / Q4_1 blocks (foreign.to_gguf_blocks: int8 and
symmetric int4 exactly; asymmetric int4 up to float16 rounding of each block's minimum), 16-bit
matrices as F16 (BF16 kept where float16 would round it), norms and biases as F32, as llama.cpp's
own converter writes them; the tokenizer, its special tokens and the chat template in the metadata."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from qlite.arch import moe
from qlite.checkpoint import CheckpointDir
from qlite.errors import QliteError
from qlite.gguf import gguf_name
from qlite.outputs import atomic_output_file, check_output_file
from qlite.tokenizer import read_tokenizer

from . import foreign

FILE_TYPES = {"Q8_0": 7, "Q4_0": 2, "Q4_1": 3, None: 1}  # llama.cpp's LlamaFileType: MOSTLY_*, F16
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED = 1, 3, 4, 5

SQUARE_ATTENTION = ("qwen2", "qwen2moe")  # llama.cpp's loaders size q_proj and o_proj hidden x hidden


def tokenizer_metadata(src: CheckpointDir, vocab_size: int) -> tuple[list[str], list[int]]:
    """Every token id's text and GGUF token type, as llama.cpp's converter makes them: added special
    tokens are control tokens, other added tokens user-defined, ids the tokenizer lacks [PADn]."""
    path = src.path / "tokenizer.json"
    tok = read_tokenizer(src.path)
    by_id = {i: t for t, i in tok.get_vocab(with_added_tokens=True).items()}
    added = tok.get_added_tokens_decoder()
    if by_id and max(by_id) >= vocab_size:
        raise QliteError(f"{path}: token id {max(by_id)} is past the config's vocab_size {vocab_size}")
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(TOKEN_UNUSED)
        else:
            tokens.append(by_id[i])
            types.append(TOKEN_NORMAL if i not in added else TOKEN_CONTROL if added[i].special else TOKEN_USER_DEFINED)
    return tokens, types


def dense_array(t: torch.Tensor) -> np.ndarray:
    """Norms and biases as float32; matrices as stored (float16, float32, or bfloat16 as raw bytes)."""
    if t.ndim == 1:
        return t.float().numpy()
    return t.contiguous().view(torch.uint8).numpy() if t.dtype == torch.bfloat16 else t.numpy()


def in_gguf_order(name: str, rows: torch.Tensor, cfg) -> torch.Tensor:
    """A tensor's rows (HF name) in the order llama.cpp's converter writes them (arch.gguf_rows)."""
    order = cfg.arch.gguf_rows(name, rows.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads)
    return rows if order is None else rows[order]


def quantized_kind(src: CheckpointDir, module: str, fmt) -> tuple[str, int, int]:
    """A quantized linear's GGUF block type, rows and input width."""
    if not fmt.exports:
        raise QliteError(f"{src.path}: {module} is {fmt.name}; GGUF export takes qlite's int4 and int8")
    k = foreign.stored_in_features(src, module, fmt)
    return foreign.gguf_type(fmt.bits, foreign.affine_zeros(src, module, fmt), module), src.tensors[f"{module}.qweight"].shape[0], k


def expert_stack(src: CheckpointDir, stack: str, modules: list[str], kinds: set, notes: list) -> tuple:
    """The plan entry of a layer's experts (their modules in order) as llama.cpp's one 3-D tensor (expert, rows,
    columns): 16-bit as stored, quantized as blocks of one type (a layer whose experts' types differ is
    written as Q8_0, which holds each int4 or int8 block exactly)."""
    from gguf import GGMLQuantizationType

    cfg, qcfg, name = src.config, src.config.quantization, gguf_name(f"{stack}.weight", src.config.arch)
    fmts = [qcfg.format_for(m) if qcfg is not None else None for m in modules]
    if all(f is None for f in fmts):
        infos = [src.tensors[f"{m}.weight"] for m in modules]
        if len({(i.dtype, tuple(i.shape)) for i in infos}) > 1:
            raise QliteError(f"{src.path}: {stack}: experts stored in different dtypes or shapes")
        raw = GGMLQuantizationType.BF16 if infos[0].dtype == "BF16" else None
        n, k = infos[0].shape
        dtype = {"F16": np.float16, "F32": np.float32, "BF16": np.uint8}[infos[0].dtype]
        shape = (len(modules), n, 2 * k if raw else k)
        return (name, (shape, dtype, len(modules) * infos[0].nbytes, raw),
                lambda: np.stack([dense_array(src.read(f"{m}.weight")) for m in modules]))
    if any(f is None for f in fmts):
        raise QliteError(f"{src.path}: {stack}: some experts 16-bit and some quantized; GGUF holds a layer's experts "
                         f"as one tensor of one type")
    found = [quantized_kind(src, m, f) for m, f in zip(modules, fmts)]
    kind = found[0][0] if len({f[0] for f in found}) == 1 else "Q8_0"
    if kind != found[0][0] or any(f[0] != kind for f in found):
        notes.append(f"{stack}: experts in {', '.join(sorted({f[0] for f in found}))} written as Q8_0 (exact)")
    if len({f[1:] for f in found}) > 1:
        raise QliteError(f"{src.path}: {stack}: experts of different shapes")
    kinds.add(kind)
    n, k = found[0][1:]
    row_bytes = k // foreign.GGUF_BLOCK * foreign.GGUF_BLOCK_BYTES[kind]

    def blocks():
        return np.stack([foreign.to_gguf_blocks(f, foreign.read_module(src, m, f, None)[0], k, m, kind)[1].numpy()
                         for m, f in zip(modules, fmts)])
    return (name, ((len(modules), n, row_bytes), np.uint8, len(modules) * n * row_bytes,
                   getattr(GGMLQuantizationType, kind)), blocks)


def export_gguf(src: CheckpointDir, out: Path, force: bool, progress: bool) -> list[str]:
    from gguf import GGMLQuantizationType, GGUFWriter, RopeScalingType, SpecialVocab

    check_output_file(out, force, b"GGUF", inputs=(src.path,))
    cfg, qcfg = src.config, src.config.quantization
    if qcfg is not None and qcfg.input_order:
        raise QliteError(f"{src.path}: an act-order checkpoint (input_order); GGUF has no column order: "
                         f"export --to gptq")
    quantized = {n.removesuffix(".qweight") for n in src.tensors if n.endswith(".qweight")}
    plan = []  # (GGUF name, (shape, numpy dtype, bytes, GGML type or None), producer of the array)
    kinds, notes = set(), []
    stacks = {}  # a mixture of experts' stack (merged module) -> its experts' modules in order
    for name, info in src.tensors.items():
        module, _, suffix = name.rpartition(".")
        if module in quantized and suffix not in ("qweight", "bias"):
            continue
        if (merged := moe.merged_name(module)) is not None:
            stacks.setdefault(merged[0], []).append(module)
            continue
        if module in quantized and suffix == "qweight":
            fmt = qcfg.format_for(module)
            kind, n, k = quantized_kind(src, module, fmt)
            if module != "lm_head":
                kinds.add(kind)  # the file type names the decoder's
            row_bytes = k // foreign.GGUF_BLOCK * foreign.GGUF_BLOCK_BYTES[kind]

            def blocks(m=module, f=fmt, k=k):
                stored = foreign.read_module(src, m, f, None)[0]
                return in_gguf_order(f"{m}.weight", foreign.to_gguf_blocks(f, stored, k, m)[1], cfg).numpy()
            plan.append((gguf_name(f"{module}.weight", cfg.arch), ((n, row_bytes), np.uint8, n * row_bytes,
                                                         getattr(GGMLQuantizationType, kind)), blocks))
        elif len(info.shape) == 1:
            plan.append((gguf_name(name, cfg.arch), (info.shape, np.float32, 4 * info.shape[0], None),
                         lambda n=name: dense_array(in_gguf_order(n, src.read(n), cfg))))
        else:
            raw = GGMLQuantizationType.BF16 if info.dtype == "BF16" else None
            shape = (info.shape[0], info.shape[1] * 2) if raw else info.shape
            dtype = {"F16": np.float16, "F32": np.float32, "BF16": np.uint8}[info.dtype]
            plan.append((gguf_name(name, cfg.arch), (shape, dtype, info.nbytes, raw),
                         lambda n=name: dense_array(in_gguf_order(n, src.read(n), cfg))))
    for stack, modules in stacks.items():
        plan.append(expert_stack(src, stack, sorted(modules, key=lambda m: moe.merged_name(m)[1]), kinds, notes))
    main_kind = "Q4_1" if "Q4_1" in kinds else next(iter(kinds), None)
    if "Q4_1" in kinds:
        notes.append("asymmetric int4 written as Q4_1: each block's minimum (-zero * scale) is rounded to float16")
    tokens, types = tokenizer_metadata(src, cfg.vocab_size)
    experts_metadata = cfg.arch.gguf_metadata(cfg, str(src.path))

    with atomic_output_file(out) as tmp:
        writer = GGUFWriter(tmp, cfg.arch.gguf_arch)
        writer.add_name(src.path.name)
        writer.add_context_length(cfg.max_position_embeddings)
        writer.add_embedding_length(cfg.hidden_size)
        writer.add_feed_forward_length(cfg.intermediate_size)
        writer.add_block_count(cfg.num_hidden_layers)
        writer.add_head_count(cfg.num_attention_heads)
        writer.add_head_count_kv(cfg.num_key_value_heads)
        if cfg.arch.gguf_arch in SQUARE_ATTENTION and cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:
            raise QliteError(f"{src.path}: head_dim {cfg.head_dim} x {cfg.num_attention_heads} heads is not the hidden "
                             f"size {cfg.hidden_size}, and llama.cpp's {cfg.arch.gguf_arch} takes q and o as hidden x "
                             f"hidden (not exported)")
        if cfg.explicit_head_dim is not None:
            writer.add_key_length(cfg.head_dim)
            writer.add_value_length(cfg.head_dim)
        writer.add_rope_freq_base(cfg.rope_theta)
        scaling = dict(cfg.rope_scaling or ())
        if scaling.get("rope_type") in ("linear", "yarn"):  # llama.cpp's keys; Llama 3.1's it holds as rope_freqs
            writer.add_rope_scaling_type(RopeScalingType(scaling["rope_type"]))
            writer.add_rope_scaling_factor(scaling["factor"])
            if "original_max_position_embeddings" in scaling:
                writer.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
        elif scaling:  # llama.cpp has no dynamic NTK; Llama 3.1's factors would go in a rope_freqs tensor
            raise QliteError(f"{src.path}: rope scaling {scaling['rope_type']}: llama.cpp's GGUF has no key for it "
                             f"(not exported)")
        writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
        for key, value in experts_metadata.items():
            writer.add_uint32(f"{cfg.arch.gguf_arch}.{key}", value)
        writer.add_file_type(FILE_TYPES[main_kind])
        writer.add_quantization_version(2)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(cfg.arch.gguf_pre)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        SpecialVocab(src.path, load_merges=True, n_vocab=cfg.vocab_size).add_to_gguf(writer, quiet=True)
        for gname, (shape, dtype, nbytes, raw), _ in plan:
            writer.add_tensor_info(gname, shape, np.dtype(dtype), nbytes, raw_dtype=raw)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        from tqdm import tqdm
        for _, _, produce in tqdm(plan, desc="export", unit="tensor", disable=not progress, leave=False):
            writer.write_tensor_data(produce())
        writer.close()
    return notes
