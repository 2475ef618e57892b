"""Chunking eval text into fixed-length token windows. The built-in eval texts live in qlite/texts.py,
beside the calibration text they are disjoint from."""
from __future__ import annotations

from qlite.errors import QliteError


def chunk_tokens(ids: list[int], ctx: int, max_chunks: int | None = None) -> list[list[int]]:
    """Consecutive, non-overlapping windows of exactly ctx tokens (a short tail is dropped)."""
    if ctx < 2:
        raise QliteError(f"--ctx {ctx}: must be at least 2")
    chunks = [ids[i:i + ctx] for i in range(0, len(ids) - ctx + 1, ctx)]
    if not chunks:
        raise QliteError(f"the text has {len(ids)} tokens, fewer than one --ctx {ctx} chunk")
    return chunks[:max_chunks] if max_chunks else chunks
