"""The bitsandbytes formats, quantized by bitsandbytes itself, for side-by-side comparison with
qlite's: NF4 (QLoRA; blocks of 64 weights, float32 absmax) and LLM.int8 (int8 per row, float32 row
absmax; outliers handled at inference). Returns tensors in the layout of qlite/formats.py."""
from __future__ import annotations

import torch


def quantize_nf4(w: torch.Tensor, blocksize: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (qweight uint8 [N, K/2], absmax fp32 [N, K/blocksize])."""
    from qlite.formats import load_bitsandbytes

    N, K = w.shape
    packed, state = load_bitsandbytes().functional.quantize_4bit(w.float().contiguous(), blocksize=blocksize, quant_type="nf4")
    return packed.reshape(N, K // 2), state.absmax.reshape(N, K // blocksize)  # (N, K/2), (N, K/blocksize)


def quantize_llm_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (qweight int8 [N, K], scb fp32 [N])."""
    from qlite.formats import load_bitsandbytes

    codes, row_absmax, _ = load_bitsandbytes().functional.int8_vectorwise_quant(w.half().contiguous())
    return codes, row_absmax.float()
